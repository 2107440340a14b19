"""Absolute position embeddings added to the token embeddings: sinusoidal and learned."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig, max_len_field, max_wavelength_field
from roformer.posenc.registry import register

EXTRAPOLATING_KINDS = ("rope", "alibi", "t5", "xpos", "nope")


def sinusoidal_embedding(pos_BL: jax.Array, dim: int, max_wavelength: float = 10000.0) -> jax.Array:
  """Vaswani et al.'s table: angle pos / b^(2 floor(j/2) / dim), sin on even j, cos on odd j.

  This is the paper's own interleaved layout (PE(pos, 2i) = sin, PE(pos, 2i+1) = cos), the same
  angles as HF RoFormer/Marian, which store them as [sin | cos] instead; the two differ only by a
  fixed permutation of the embedding dims, which a model trained from scratch cannot tell apart.

  Args:
    pos_BL: integer positions [B, L].
    dim: D, the embedding width (odd allowed: the last cos is dropped).
    max_wavelength: the base b.

  Returns:
    float32 [B, L, D].
  """
  half = (dim + 1) // 2
  inv_freq = max_wavelength ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / dim)
  angle_BLk = pos_BL.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  pe_BLk2 = jnp.stack([jnp.sin(angle_BLk), jnp.cos(angle_BLk)], axis=-1)
  return pe_BLk2.reshape(*pos_BL.shape, 2 * half)[..., :dim]


@register("sinusoidal")
class Sinusoidal(PosEnc):
  """Fixed sinusoidal absolute positions (Vaswani et al. 2017), added to the embeddings.

  The table has unit amplitude, so its paper scales the token embeddings to match (section 3.4:
  "we multiply those weights by sqrt(d_model)"; fairseq's N(0, 1/d) table times sqrt(d)). With
  BERT's N(0, 0.02^2) tokens instead, position outweighs token identity by about 35 to 1.
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    max_wavelength: float = max_wavelength_field()

  paper_embed_scale = "sqrt_d"

  def embed(self, x_BLD, pos_BL):
    """x [B, L, D] + the sinusoidal table at `pos_BL`, in the dtype of x."""
    check_positions(pos_BL, "pos_BL", x_BLD.shape[:2])
    pe_BLD = sinusoidal_embedding(pos_BL, x_BLD.shape[-1], self.cfg.max_wavelength)
    return x_BLD + pe_BLD.astype(x_BLD.dtype)


@register("learned")
class Learned(PosEnc):
  """A learned table of posenc.max_len absolute positions (BERT), added to the embeddings.

  Initialised like the token table it is added to: N(0, 0.02^2) as BERT, or N(0, 1/d) as
  fairseq's learned positions when tokens are N(0, 1/d) times sqrt(d). BERT decays it like any
  other table (only LayerNorm and biases are excluded), so it keeps its weight decay.

  Positions at or past max_len have no row: a longer input is a ValueError at trace time, and
  an out-of-range position inside a shorter input reads NaN instead of a silently clamped row.
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    max_len: int = max_len_field()

  def __init__(self, cfg: PosEncConfig, *, emb_dim: int, rngs: nnx.Rngs, **kwargs):
    super().__init__(cfg, emb_dim=emb_dim, rngs=rngs, **kwargs)
    init = nnx.with_partitioning(nnx.initializers.normal(self.embed_init_std), (None, "embed"))
    self.table = nnx.Param(init(rngs.params(), (cfg.max_len, emb_dim), self.param_dtype))

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if cfg.max_len <= 0:
      raise ValueError(f"posenc.max_len={cfg.max_len} must be > 0 for posenc.kind='learned'")

  @classmethod
  def unsupported_length(cls, cfg: PosEncConfig, length: int) -> str | None:
    return _too_long_message(length, cfg.max_len) if length > cfg.max_len else None

  decays_parameters = True

  def embed(self, x_BLD, pos_BL):
    """x [B, L, D] + table[pos], in the dtype of x; raises if L > posenc.max_len."""
    check_positions(pos_BL, "pos_BL", x_BLD.shape[:2])
    if x_BLD.shape[1] > self.cfg.max_len:
      raise ValueError(_too_long_message(x_BLD.shape[1], self.cfg.max_len))
    pe_BLD = jnp.take(self.table[...], pos_BL, axis=0, mode="fill", fill_value=jnp.nan)
    return x_BLD + pe_BLD.astype(x_BLD.dtype)


def _too_long_message(length: int, max_len: int) -> str:
  return (
    f"length {length} exceeds posenc.max_len={max_len}: posenc.kind='learned' has no embedding "
    f"past its table; raise posenc.max_len or use an encoding that extrapolates "
    f"(posenc.kind in {EXTRAPOLATING_KINDS})"
  )
