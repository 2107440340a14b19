"""PoPE, polar coordinate position embeddings (Gopalakrishnan et al. 2025, arXiv 2509.10534).

RoPE rotates pairs of query/key dims, so the angle of a pair mixes the content's own phase (the
"what") with the position's (the "where"). PoPE makes every one of a head's K dims a complex
number whose magnitude is content and whose phase is position alone:

  q~_t,c = mu_q,c e^{i t theta_c},    k~_s,c = mu_k,c e^{i (s theta_c + delta_c)},
  mu_c = softplus(x_c),    theta_c = b^(-c/K),    c = 0 .. K-1,

with K frequencies (RoPE has K/2), b = `posenc.max_wavelength`, and delta_c a learned phase bias
of the keys, per head, clamped to [-2 pi, 0]. The score of a query at t and a key at s is

  a_ts = Re[q~_t^H k~_s] = sum_c mu_q,c mu_k,c cos((s - t) theta_c + delta_c),

and attention is softmax(a_ts / sqrt(K)). In real arithmetic

  q' = [mu_q cos(t theta), mu_q sin(t theta)],
  k' = [mu_k cos(s theta + delta), mu_k sin(s theta + delta)],

2K dims each, with q' . k' = a_ts: `rotate` returns queries and keys twice as wide as the values,
which keep K dims (`Pope.rotated_dim`; the kernels and the KV cache take a key width other than
the value width). The kernels divide the logits by sqrt of the query/key width, sqrt(2K), so
queries are multiplied by sqrt(2): the logits stay the paper's a_ts / sqrt(K). The two halves
[cos | sin] need no pairing convention: q' . k' is the same under any permutation applied to both.

Angles, softplus, sin and cos are float32 whatever the compute dtype (see rope.py: bfloat16
angles are wrong by whole turns at long positions); the features are cast back to the input's
dtype. The bias delta is [G, K] with G = `model.num_kv_heads`: keys have G heads, so under
grouped-query attention the query heads of a group share their key head's bias (with G = H it is
the paper's per-head bias), and a cached key holds its bias already. One delta serves every layer
(the encoding is one module per model, as T5's table and KERPLE's slopes). It starts at zero
(`posenc.pope_bias_init="zeros"`) or uniform in [-2 pi, 0] ("uniform", the paper's other option),
and stays in [-2 pi, 0]: the forward pass reads the clamp with the gradient of delta itself (a
clamp that never freezes a parameter at its bound), and `constrain`, which the train step calls
after every update, writes the clamp into the parameter.

The scalings of RoPE (PI, NTK, YaRN, ...) are formulas for RoPE's K/2 frequencies b^(-2i/K) and
its attention factor; they do not carry over to PoPE's K frequencies and are refused, as are the
context extensions (PoPE extrapolates without them, the paper's point).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig, max_wavelength_field, param
from roformer.posenc.registry import register

POPE_BIAS_INITS = ("zeros", "uniform")
POPE_BIAS_MIN, POPE_BIAS_MAX = -2.0 * math.pi, 0.0


def pope_frequencies(head_dim: int, max_wavelength: float = 10000.0) -> np.ndarray:
  """theta_c = b^(-c/K) for c = 0 .. K-1, float32 [K] (one frequency per dim, not per pair)."""
  c = np.arange(head_dim, dtype=np.float64)
  return (max_wavelength ** (-c / head_dim)).astype(np.float32)


def clamp_phase_bias(delta):
  """clip(delta, -2 pi, 0) in the forward pass, with the gradient of delta itself (straight
  through), float32."""
  delta = delta.astype(jnp.float32)
  return delta + jax.lax.stop_gradient(jnp.clip(delta, POPE_BIAS_MIN, POPE_BIAS_MAX) - delta)


def pope_features(
  x_BLHK: jax.Array,
  pos_BL: jax.Array,
  inv_freq_K,
  phase_HK: jax.Array | None = None,
  scale: float = 1.0,
) -> jax.Array:
  """Polar features [mu cos(phi), mu sin(phi)] * scale of queries or keys, phi = p theta + delta.

  Args:
    x_BLHK: queries or keys [B, L, H, K], any float dtype.
    pos_BL: integer positions [B, L].
    inv_freq_K: float32 [K] frequencies theta (`pope_frequencies`).
    phase_HK: float32 phase bias [H, K] added to every angle (keys), or None (queries).
    scale: multiplies the features (sqrt(2) for queries, see the module doc).

  Returns:
    [B, L, H, 2K] in the dtype of x: the cos half, then the sin half.
  """
  # Positions go to float32 before the product: exact up to 2^24.
  inv_freq_111K = jnp.asarray(inv_freq_K, jnp.float32)[None, None, None, :]
  angle_BLhK = pos_BL.astype(jnp.float32)[:, :, None, None] * inv_freq_111K  # h = 1 or H
  if phase_HK is not None:
    angle_BLhK = angle_BLhK + phase_HK.astype(jnp.float32)[None, None]
  mu_BLHK = jax.nn.softplus(x_BLHK.astype(jnp.float32)) * scale
  features = [mu_BLHK * jnp.cos(angle_BLhK), mu_BLHK * jnp.sin(angle_BLhK)]
  return jnp.concatenate(features, axis=-1).astype(x_BLHK.dtype)


@register("pope")
class Pope(PosEnc):
  """PoPE: softplus magnitudes, phases t theta_c (queries) and s theta_c + delta_c (keys).

  `rotate` maps queries [B, L, H, K] and keys [B, S, G, K] to [..., 2K]; values stay [..., K].
  Parameters: delta [G, K] ('heads', 'kv'), no weight decay (a phase is not a weight to shrink
  toward 0). Frequencies are constants of (K, b), so `prepare` has no state to compute.
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    max_wavelength: float = max_wavelength_field()
    pope_bias_init: str = param(
      "zeros",
      "initial key phase bias delta (per key/value head and dim, kept in [-2 pi, 0]): 'zeros' or "
      "'uniform' in [-2 pi, 0] (the paper's two options)",
    )

  def __init__(self, cfg: PosEncConfig, *, head_dim: int, rngs: nnx.Rngs, **kwargs):
    super().__init__(cfg, head_dim=head_dim, rngs=rngs, **kwargs)
    shape = (self.num_kv_heads, head_dim)

    def init(key, shape, dtype):
      if cfg.pope_bias_init == "uniform":
        return jax.random.uniform(key, shape, dtype, POPE_BIAS_MIN, POPE_BIAS_MAX)
      return jnp.zeros(shape, dtype)

    init = nnx.with_partitioning(init, ("heads", "kv"))
    self.delta = nnx.Param(init(rngs.params(), shape, self.param_dtype))

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if cfg.pope_bias_init not in POPE_BIAS_INITS:
      raise ValueError(
        f"posenc.pope_bias_init={cfg.pope_bias_init!r} is not one of {POPE_BIAS_INITS}"
      )
    if not cfg.max_wavelength > 1:
      raise ValueError(f"posenc.max_wavelength={cfg.max_wavelength} must be > 1")
    if cfg.rope_fraction != 1.0:
      raise ValueError(
        f"posenc.rope_fraction={cfg.rope_fraction} applies to the rotary encodings; "
        "posenc.kind='pope' gives every dim of a head a phase: set it to 1.0"
      )

  @classmethod
  def rotated_dim(cls, cfg: PosEncConfig, head_dim: int) -> int:
    del cfg
    return 2 * head_dim

  def constrain(self) -> None:
    """Clamps delta into [-2 pi, 0] in place (the train step calls it after every update)."""
    delta = self.delta[...]
    self.delta[...] = jnp.clip(delta, POPE_BIAS_MIN, POPE_BIAS_MAX).astype(delta.dtype)

  def rotate(self, q_BLHK, k_BSGK, qpos_BL, kpos_BS, state=None):
    """Polar features of q [B, L, H, K] and k [B, S, G, K]: [B, L, H, 2K] and [B, S, G, 2K].

    Queries carry the factor sqrt(2) that turns the kernels' 1 / sqrt(2K) into the paper's
    1 / sqrt(K); keys carry the phase bias of their head. Dtypes are preserved.
    """
    del state  # the frequencies are constants; nothing depends on the pass's positions
    K, G = self.head_dim, self.num_kv_heads
    for name, x, heads in (("q_BLHK", q_BLHK, None), ("k_BSGK", k_BSGK, G)):
      if x.ndim != 4 or x.shape[-1] != K or (heads is not None and x.shape[2] != heads):
        want = f"[B, L, {'heads' if heads is None else heads}, {K}]"
        raise ValueError(
          f"{name} must be {want} (model.num_kv_heads key heads), got {tuple(x.shape)}"
        )
    check_positions(qpos_BL, "qpos_BL", q_BLHK.shape[:2])
    check_positions(kpos_BS, "kpos_BS", k_BSGK.shape[:2])
    inv_freq_K = pope_frequencies(K, self.cfg.max_wavelength)
    delta_GK = clamp_phase_bias(self.delta[...])
    return (
      pope_features(q_BLHK, qpos_BL, inv_freq_K, scale=math.sqrt(2.0)),
      pope_features(k_BSGK, kpos_BS, inv_freq_K, delta_GK),
    )
