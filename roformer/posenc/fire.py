"""FIRE (Li et al. 2024): a learned MLP of the progressively normalised log distance, per head."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig, param
from roformer.posenc.registry import register

FIRE_EPS = 1e-6  # keeps the normaliser's log away from 0 (the paper's code)


def fire_normalized_distance(qpos_BL, kpos_BS, c, threshold):
  """psi(i - j) / psi(max(L, i)) with psi(x) = log(|c x| + 1), float32 [B, L, S].

  i is the query position, j the key position, L = `threshold`. Dividing by psi of the query
  position (not of a fixed training length) is the progressive interpolation: every distance a
  query can see maps into [0, 1], at any length; below L the normaliser is constant, so short
  sequences keep distinct values for distinct distances.
  """
  c = jnp.asarray(c, jnp.float32)
  rel_BLS = (qpos_BL[:, :, None] - kpos_BS[:, None, :]).astype(jnp.float32)
  normaliser_BL1 = jnp.maximum(qpos_BL.astype(jnp.float32), threshold)[:, :, None]
  numerator_BLS = jnp.log(jnp.abs(c * rel_BLS) + 1.0)
  denominator_BL1 = jnp.log(jnp.abs(c * normaliser_BL1) + 1.0) + FIRE_EPS
  return numerator_BLS / denominator_BL1


def fire_mlp(x_BLS, w1_W, b1_W, w2_WH, b2_H):
  """f_theta: R -> R^H, the two-layer ReLU MLP applied to every entry; float32 [B, H, L, S]."""
  w1_111W = w1_W.astype(jnp.float32)[None, None, None, :]
  b1_111W = b1_W.astype(jnp.float32)[None, None, None, :]
  h_BLSW = jax.nn.relu(x_BLS[..., None] * w1_111W + b1_111W)
  out_BHLS = jnp.einsum("blsw,wh->bhls", h_BLSW, w2_WH.astype(jnp.float32))
  return out_BHLS + b2_H.astype(jnp.float32)[None, :, None, None]


@register("fire")
class Fire(PosEnc):
  """FIRE: b(i, j) = f_theta(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1), per head.

  f_theta is a two-layer MLP (1 -> posenc.fire_mlp_width -> H, ReLU) with one output per head;
  c (initialised to posenc.fire_init_c = 0.1) is learned, and the threshold is
  L = |l_multiplier * posenc.fire_init_threshold| with l_multiplier learned from 1 (so L starts
  at 512), as in the paper's code; both logs take |c x| so the bias stays defined whatever c
  learns. The MLP layers start as PyTorch's nn.Linear does (uniform in +-1/sqrt(fan_in)), which
  the paper's code uses. Every attention layer has its own MLP, c and threshold (`per_layer`),
  as the paper's FIRE; posenc.fire_shared gives all layers one, the paper's layer-shared
  variant FIRE-S. An encoder
  gets the symmetric form |i - j| (the paper defines FIRE for causal attention).
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    fire_mlp_width: int = param(32, "hidden width of the MLP f_theta (paper: 32)", reshapes=True)
    fire_init_c: float = param(0.1, "initial c of psi(x) = log(c x + 1), learned (paper: 0.1)")
    fire_init_threshold: float = param(
      512.0, "initial threshold L of the normaliser psi(max(L, i)), learned (paper: 512)"
    )
    fire_shared: bool = param(
      False,
      "one MLP shared by every layer (the paper's FIRE-S) instead of one per layer (FIRE)",
      reshapes=True,
    )

  def __init__(self, cfg: PosEncConfig, *, num_heads: int, rngs: nnx.Rngs, **kwargs):
    super().__init__(cfg, num_heads=num_heads, rngs=rngs, **kwargs)
    W, H, dtype = cfg.fire_mlp_width, num_heads, self.param_dtype

    def linear_init(fan_in, names):
      bound = 1.0 / math.sqrt(fan_in)

      def init(key, shape, dtype):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

      return nnx.with_partitioning(init, names)

    self.w1 = nnx.Param(linear_init(1, (None,))(rngs.params(), (W,), dtype))
    self.b1 = nnx.Param(linear_init(1, (None,))(rngs.params(), (W,), dtype))
    self.w2 = nnx.Param(linear_init(W, (None, "heads"))(rngs.params(), (W, H), dtype))
    self.b2 = nnx.Param(linear_init(W, ("heads",))(rngs.params(), (H,), dtype))
    self.c = nnx.Param(jnp.asarray(cfg.fire_init_c, dtype))
    self.l_multiplier = nnx.Param(jnp.asarray(1.0, dtype))

  @classmethod
  def per_layer(cls, cfg: PosEncConfig) -> bool:
    return not cfg.fire_shared

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if cfg.fire_mlp_width < 1:
      raise ValueError(f"posenc.fire_mlp_width={cfg.fire_mlp_width} must be >= 1")
    if not cfg.fire_init_c > 0:
      raise ValueError(f"posenc.fire_init_c={cfg.fire_init_c} must be > 0")
    if not cfg.fire_init_threshold > 0:
      raise ValueError(f"posenc.fire_init_threshold={cfg.fire_init_threshold} must be > 0")

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    threshold = jnp.abs(self.l_multiplier[...].astype(jnp.float32) * self.cfg.fire_init_threshold)
    x_BLS = fire_normalized_distance(qpos_BL, kpos_BS, self.c[...], threshold)
    return fire_mlp(x_BLS, self.w1[...], self.b1[...], self.w2[...], self.b2[...])
