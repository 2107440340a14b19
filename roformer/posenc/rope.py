"""Rotary position embedding (RoFormer, Su et al. 2021) and xPos (Sun et al. 2022).

Angles, sin and cos are always float32 (positions are cast before multiplying): in bfloat16 a
position such as 65,537 is not even representable, so reduced-precision angles are wrong by
whole turns. Rotation happens in float32 and the result is cast back to the input dtype.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig, max_wavelength_field, param
from roformer.posenc.extension import position_pieces
from roformer.posenc.prope import truncate_frequencies
from roformer.posenc.registry import register
from roformer.posenc.resonance import resonance_frequencies
from roformer.posenc.rope_scaling import check_scaling, rope_frequencies


def rotary_dims(head_dim: int, rope_fraction: float) -> int:
  """The number of rotated dims: rope_fraction * head_dim rounded down to an even number."""
  # The tiny epsilon keeps e.g. 0.29 * 100 = 28.999... from losing a pair to float rounding.
  return 2 * int(rope_fraction * head_dim / 2 + 1e-9)


def rope_sin_cos(
  pos_BL: jax.Array, inv_freq: jax.Array, scale: float | jax.Array = 1.0
) -> tuple[jax.Array, jax.Array]:
  """Float32 sin and cos of the angles pos * theta_i, times `scale`.

  Args:
    pos_BL: integer positions [B, L].
    inv_freq: float32 [d/2] inverse frequencies (`rope_frequencies`).
    scale: a float (e.g. the attention factor of a scaling) or a float32 [B, L, d/2] array.

  Returns:
    (sin_BLk, cos_BLk), float32 [B, L, d/2].
  """
  # Positions go to float32 before the product: exact up to 2^24.
  angle_BLk = pos_BL.astype(jnp.float32)[:, :, None] * inv_freq.astype(jnp.float32)[None, None, :]
  return jnp.sin(angle_BLk) * scale, jnp.cos(angle_BLk) * scale


def _partners(d: int, layout: str) -> np.ndarray:
  """partner[j]: the other dim of j's pair. "interleaved": pairs (2i, 2i+1), the RoFormer paper,
  HF RoFormer checkpoints, bert4keras; "half": pairs (i, i + d/2), GPT-NeoX, LLaMA, flaxformer."""
  j = np.arange(d)
  if layout == "interleaved":
    return j ^ 1
  return (j + d // 2) % d


def _per_dim(first_BL1k, second_BL1k, layout: str):
  """[B, L, 1, d]: a pair's first dim gets `first`, its second dim `second`."""
  if layout == "interleaved":
    both = jnp.stack([first_BL1k, second_BL1k], axis=-1)
    return both.reshape(*both.shape[:-2], -1)
  return jnp.concatenate([first_BL1k, second_BL1k], axis=-1)


def _rotate(x_BLHd, sin_BL1k, cos_BL1k, layout: str):
  """Each pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as x cos + partner(x) (-+sin).

  partner(x), which swaps the dims of every pair, is a product with a fixed permutation matrix:
  exact, since each output sums one product with 1 and products with 0 (HIGHEST precision, so
  no accelerator rounds x to bfloat16 on the way), and its backward pass is a product too.
  Written with slices and a concatenate (or a stack), the backward pass concatenates the
  gradients of the halves, which XLA:CPU runs slowly (about 8% of a decoder train step).
  """
  d = x_BLHd.shape[-1]
  swap_dd = np.zeros((d, d), np.float32)
  swap_dd[_partners(d, layout), np.arange(d)] = 1.0
  partner_BLHd = jnp.matmul(
    x_BLHd.reshape(-1, d), jnp.asarray(swap_dd), precision=jax.lax.Precision.HIGHEST
  ).reshape(x_BLHd.shape)
  return x_BLHd * _per_dim(cos_BL1k, cos_BL1k, layout) + partner_BLHd * _per_dim(
    -sin_BL1k, sin_BL1k, layout
  )


ROTATIONS = ("interleaved", "half")


def apply_rotary(
  x_BLHK: jax.Array, sin_BLk: jax.Array, cos_BLk: jax.Array, *, layout: str = "interleaved"
) -> jax.Array:
  """Rotates the first d = 2 * sin.shape[-1] dims of every head; the rest pass through.

  Each pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32.

  Args:
    x_BLHK: queries or keys [B, L, H, K], any float dtype.
    sin_BLk, cos_BLk: float32 [B, L, d/2] (`rope_sin_cos`), shared by all heads.
    layout: "interleaved" (pairs 2i, 2i+1) or "half" (pairs i, i + d/2).

  Returns:
    [B, L, H, K] in the dtype of x.
  """
  if layout not in ROTATIONS:
    raise ValueError(f"posenc.rope_layout={layout!r} is not one of {ROTATIONS}")
  d = 2 * sin_BLk.shape[-1]
  if x_BLHK.ndim != 4 or d > x_BLHK.shape[-1]:
    raise ValueError(f"expected [B, L, H, K] with K >= {d}, got shape {tuple(x_BLHK.shape)}")
  rotated = _rotate(
    x_BLHK[..., :d].astype(jnp.float32), sin_BLk[:, :, None, :], cos_BLk[:, :, None, :], layout
  ).astype(x_BLHK.dtype)
  if d == x_BLHK.shape[-1]:
    return rotated
  return jnp.concatenate([rotated, x_BLHK[..., d:]], axis=-1)


def rope_long_term_decay(head_dim: int, max_distance: int, base: float = 10000.0) -> np.ndarray:
  """RoFormer's long-term-decay bound (section 3.4.3) against relative distance.

  With theta_k = base^(-2k/d) and S_j = sum_{k<j} exp(i m theta_k), the attention score of a
  relative distance m is bounded by max_i |h_i - h_{i+1}| * sum_j |S_j|; this returns the
  relative-distance part (1 / (d/2)) sum_{j=1}^{d/2} |S_j|, which decays as m grows.

  Args:
    head_dim: d (even).
    max_distance: the largest m.
    base: the RoPE base.

  Returns:
    float64 [max_distance + 1], the value for m = 0 .. max_distance.
  """
  if head_dim < 2 or head_dim % 2:
    raise ValueError(f"head_dim must be even and >= 2, got {head_dim}")
  theta = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  m = np.arange(max_distance + 1, dtype=np.float64)
  partial_sums = np.cumsum(np.exp(1j * m[:, None] * theta[None, :]), axis=1)  # S_1 .. S_{d/2}
  return np.abs(partial_sums).mean(axis=1)


def _check_qk(q_BLHK, k_BSGK, qpos_BL, kpos_BS, head_dim):
  for name, x in (("q_BLHK", q_BLHK), ("k_BSGK", k_BSGK)):
    if x.ndim != 4 or x.shape[-1] != head_dim:
      raise ValueError(f"{name} must be [B, L, heads, {head_dim}], got {tuple(x.shape)}")
  # A query's rotation position may be fractional: Self-Extend's grouped queries under LongLM's
  # true division (posenc/extension.py). Angles are float32 products either way.
  check_positions(qpos_BL, "qpos_BL", q_BLHK.shape[:2], fractional=True)
  check_positions(kpos_BS, "kpos_BS", k_BSGK.shape[:2])


class RotaryState(NamedTuple):
  """What one forward pass (or decode step) rotates every layer's queries and keys with.

  inv_freq: float32 [d/2] inverse frequencies (dynamic NTK: for the pass's length).
  attention_factor: the scaling's multiplier of sin and cos (a float or float32 scalar).
  centre_B1: xPos's per-row centre (int [B, 1]); None for RoPE.
  """

  inv_freq: jax.Array
  attention_factor: float | jax.Array
  centre_B1: jax.Array | None = None


@register("rope")
class Rope(PosEnc):
  """Rotary position embedding on the first `rope_fraction` of each head's dims.

  Scores depend on positions only through m - n. The `posenc.scaling` of the config rescales
  the frequencies (`rope_frequencies`); its attention factor multiplies sin and cos. Dynamic
  NTK reads the current length as max(kpos_BS) + 1, a traced value inside jit: `prepare` takes
  it from all key positions of a forward pass (or a decode step), and every layer rotates with
  that one state. `posenc.rope_resonance` rounds every wavelength to an integer (Resonance RoPE,
  after the scaling: Resonance YaRN with `posenc.scaling.kind="yarn"`).
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    max_wavelength: float = max_wavelength_field()
    rope_layout: str = param(
      "interleaved",
      "pairing of dimensions: 'interleaved' (2i, 2i+1) as in RoFormer, or 'half' (i, i + d/2)",
    )
    rope_fraction: float = param(1.0, "fraction of each head's dimensions that rotate (1.0 = all)")
    rope_truncate: float = param(
      0.0,
      "p-RoPE (Barbero et al. 2024): fraction of the lowest frequencies set to zero (they do not "
      "rotate); p = 1 - rope_truncate. 0 = plain RoPE",
    )
    rope_resonance: bool = param(
      False,
      "Resonance RoPE (Wang et al. 2024): every wavelength 2 pi / theta_i rounded to an "
      "integer and theta_i recomputed, after posenc.scaling (with yarn: Resonance YaRN)",
    )

  accepts_rope_scaling = True

  def __init__(self, cfg: PosEncConfig, *, head_dim: int, **kwargs):
    super().__init__(cfg, head_dim=head_dim, **kwargs)
    self.rotary_dims = rotary_dims(head_dim, cfg.rope_fraction)
    check_scaling(cfg.scaling)  # here the original length must be known

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if head_dim % 2:
      raise ValueError(
        f"model.head_dim={head_dim} must be even for posenc.kind={cfg.kind!r} "
        "(rotary encodings rotate pairs of dims)"
      )
    if rotary_dims(head_dim, cfg.rope_fraction) < 2:
      raise ValueError(
        f"posenc.rope_fraction={cfg.rope_fraction} of model.head_dim={head_dim} leaves no pair "
        "of dims to rotate; raise posenc.rope_fraction"
      )
    if not cfg.max_wavelength > 1:
      raise ValueError(f"posenc.max_wavelength={cfg.max_wavelength} must be > 1")
    pairs = rotary_dims(head_dim, cfg.rope_fraction) // 2
    if cfg.scaling.kind == "longrope" and len(cfg.scaling.short_factor) != pairs:
      raise ValueError(
        f"posenc.scaling.short_factor and long_factor have {len(cfg.scaling.short_factor)} "
        f"entries; the rotary dims of model.head_dim={head_dim} need {pairs}"
      )
    if cfg.scaling.kind in ("ntk", "dynamic") and rotary_dims(head_dim, cfg.rope_fraction) <= 2:
      raise ValueError(
        f"posenc.scaling.kind={cfg.scaling.kind!r} needs at least 4 rotary dims "
        f"(model.head_dim={head_dim}, posenc.rope_fraction={cfg.rope_fraction})"
      )

  def frequencies(self, kpos_BS: jax.Array) -> tuple[jax.Array, float]:
    """(inv_freq float32 [d/2], attention factor) for keys at `kpos_BS`."""
    # Only "dynamic" reads seq_len; elsewhere the max is dead code that jit removes.
    seq_len = jnp.max(kpos_BS) + 1
    inv_freq, attention_factor = rope_frequencies(
      self.rotary_dims, self.cfg.max_wavelength, self.cfg.scaling, seq_len=seq_len
    )
    if self.cfg.rope_resonance:  # before truncation: a zero frequency has no wavelength
      inv_freq = resonance_frequencies(inv_freq)
    return truncate_frequencies(inv_freq, self.cfg.rope_truncate), attention_factor

  def prepare(self, kpos_BS: jax.Array) -> RotaryState:
    """Frequencies and attention factor from all key positions of the pass (see `PosEnc`)."""
    return RotaryState(*self.frequencies(kpos_BS))

  def scales(
    self, qpos_BL: jax.Array, kpos_BS: jax.Array, state: RotaryState
  ) -> tuple[float | jax.Array, float | jax.Array]:
    """Multipliers of the query and key sin/cos (`rope_sin_cos`'s `scale`): the attention factor."""
    del qpos_BL, kpos_BS
    return state.attention_factor, state.attention_factor

  def rotate(self, q_BLHK, k_BSGK, qpos_BL, kpos_BS, state=None):
    """Rotates q [B, L, H, K] and k [B, S, G, K] (G may be < H); dtypes are preserved.

    `state` is `prepare`'s result for the pass; None computes it from `kpos_BS`.
    """
    _check_qk(q_BLHK, k_BSGK, qpos_BL, kpos_BS, self.head_dim)
    if state is None:
      state = self.prepare(kpos_BS)
    scale_q, scale_k = self.scales(qpos_BL, kpos_BS, state)
    layout = self.cfg.rope_layout
    sin_q, cos_q = rope_sin_cos(qpos_BL, state.inv_freq, scale_q)
    sin_k, cos_k = rope_sin_cos(kpos_BS, state.inv_freq, scale_k)
    return (
      apply_rotary(q_BLHK, sin_q, cos_q, layout=layout),
      apply_rotary(k_BSGK, sin_k, cos_k, layout=layout),
    )

  def extends_positions(self) -> bool:
    return self.cfg.extension.kind != "none"

  def position_pieces(self, qpos_BL, kpos_BS):
    """`posenc.extension`'s pieces for a block of positions (see `PosEnc.position_pieces`)."""
    if not self.extends_positions():
      return None
    return position_pieces(self.cfg.extension, qpos_BL, kpos_BS)


@register("xpos")
class XPos(Rope):
  """xPos (Sun et al. 2022): RoPE whose pair i is scaled by zeta_i^(n / scale_base).

  zeta_i = (2i + gamma d) / ((1 + gamma) d); queries are scaled by zeta^(n/scale_base) and keys
  by zeta^(-n/scale_base), so a score carries zeta^((m - n)/scale_base), which decays with
  distance when keys precede queries (hence causal only). The position n is centred by a
  per-row constant c = (min(kpos) + max(kpos)) // 2 before scaling: c cancels in every q.k
  product rotated with one state, so scores are unchanged, while the scales stay finite far
  from position 0 (|n - c| is at most half the key span; a longer span than `xpos_max_span`,
  about 65k positions for the defaults, is refused rather than overflowing). `prepare` fixes c
  from all key positions of a pass, so queries and keys that meet in one attention share it.
  Scales are float32.

  The paper's extrapolation results use blockwise causal attention (BCA) at inference, which
  `eval.py --bca` applies; curves without it are labelled "no BCA".
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(Rope.Fields):
    """posenc.* fields of this encoding."""

    xpos_gamma: float = param(
      0.4, "gamma of the per-dimension decay base (zeta_i = (i / (d/2) + gamma) / (1 + gamma))"
    )
    xpos_scale_base: float = param(512.0, "the scale base dividing positions in the decay exponent")

  causal_only = True
  causal_reason = (
    "its scale zeta^((m - n)/scale_base) decays only for keys before the query and grows without "
    "bound for keys after it"
  )
  paper_eval_window = "blockwise"
  # The paper's language models are torchscale's fairseq ones: tokens N(0, 1/d) times sqrt(d).
  paper_embed_scale = "sqrt_d"

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if not cfg.xpos_gamma > 0:
      raise ValueError(f"posenc.xpos_gamma={cfg.xpos_gamma} must be > 0")
    if not cfg.xpos_scale_base > 0:
      raise ValueError(f"posenc.xpos_scale_base={cfg.xpos_scale_base} must be > 0")

  @classmethod
  def unsupported_length(cls, cfg: PosEncConfig, length: int) -> str | None:
    return _xpos_span_message(length, cfg) if length > xpos_max_span(cfg) else None

  def log_zeta(self) -> np.ndarray:
    """ln zeta_i, float32 [d/2]."""
    d, gamma = self.rotary_dims, self.cfg.xpos_gamma
    zeta = (np.arange(0, d, 2, dtype=np.float64) + gamma * d) / ((1 + gamma) * d)
    return np.log(zeta).astype(np.float32)

  def prepare(self, kpos_BS: jax.Array) -> RotaryState:
    """RoPE's state plus the per-row centre c = (min(kpos) + max(kpos)) // 2 (int [B, 1])."""
    # Integer arithmetic so that n - c is exact.
    c_B1 = ((jnp.min(kpos_BS, axis=1) + jnp.max(kpos_BS, axis=1)) // 2)[:, None]
    return super().prepare(kpos_BS)._replace(centre_B1=c_B1)

  def scales(self, qpos_BL, kpos_BS, state):
    """Float32 query scales zeta^((n - c)/scale_base) [B, L, d/2] and key scales [B, S, d/2].

    Keys get the inverse power; both are multiplied by the scaling's attention factor.
    """
    if kpos_BS.shape[1] > xpos_max_span(self.cfg):
      raise ValueError(_xpos_span_message(kpos_BS.shape[1], self.cfg))
    c_B1, attention_factor = state.centre_B1, state.attention_factor
    log_zeta_11k = jnp.asarray(self.log_zeta())[None, None, :]
    inv_base = 1.0 / self.cfg.xpos_scale_base
    nq_BL1 = ((qpos_BL - c_B1).astype(jnp.float32) * inv_base)[:, :, None]
    nk_BS1 = ((kpos_BS - c_B1).astype(jnp.float32) * inv_base)[:, :, None]
    scale_q = jnp.exp(nq_BL1 * log_zeta_11k) * attention_factor
    scale_k = jnp.exp(-nk_BS1 * log_zeta_11k) * attention_factor
    return scale_q, scale_k


# Largest |ln scale| xPos may reach: float32 overflows at exp(88.7), and the slack leaves room for
# query components up to e^8 before the scaled query turns infinite (and q.k NaN).
_XPOS_MAX_LOG_SCALE = 80.0


def xpos_max_span(cfg: PosEncConfig) -> int:
  """The longest span of positions one xPos `rotate` call can scale in float32.

  Centred positions reach +-span/2, and the largest scale is zeta_0^(-span / (2 scale_base)) with
  zeta_0 = gamma / (1 + gamma), the smallest zeta (about 65k positions for the defaults).
  """
  log_inv_zeta0 = math.log((1.0 + cfg.xpos_gamma) / cfg.xpos_gamma)
  return int(2 * _XPOS_MAX_LOG_SCALE * cfg.xpos_scale_base / log_inv_zeta0)


def _xpos_span_message(length: int, cfg: PosEncConfig) -> str:
  return (
    f"length {length} exceeds the {xpos_max_span(cfg)} positions posenc.kind='xpos' can scale in "
    f"float32 (posenc.xpos_scale_base={cfg.xpos_scale_base}, posenc.xpos_gamma={cfg.xpos_gamma}): "
    "its scales zeta^(n/scale_base) would overflow into NaN; evaluate shorter windows or raise "
    "posenc.xpos_scale_base"
  )
