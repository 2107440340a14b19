"""Sandwich (Chi et al. 2023): a parameter-free bias from inner products of sinusoids."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig, param
from roformer.posenc.registry import register


def sandwich_bias(qpos_BL, kpos_BS, *, dim: int, num_heads: int):
  """(sum_{i=1}^{d'/2} cos((m - n) / 10000^(2i/d')) - d'/2) / (8h / H), float32 [B, H, L, S].

  The sum is p_m . p_n for sinusoidal embeddings p of dimension d' = `dim`; subtracting d'/2
  makes it 0 at m = n and negative elsewhere. Head h = 1..H divides it by 8h/H, ALiBi's
  per-head compression as in the paper's code. Each term is summed as cos x - 1 = -2 sin^2(x/2),
  which float32 keeps exact where cos x rounds to 1 (small distances, low frequencies). The
  frequencies are summed in a loop so the memory is O(B L S), not O(B L S d'/2).
  """
  distance_BLS = (qpos_BL[:, :, None] - kpos_BS[:, None, :]).astype(jnp.float32)
  half = dim // 2
  inv_freq = jnp.asarray(10000.0 ** (-2.0 * np.arange(1, half + 1) / dim), jnp.float32)

  def add_frequency(i, total_BLS):
    return total_BLS - 2.0 * jnp.square(jnp.sin(0.5 * distance_BLS * inv_freq[i]))

  total_BLS = jax.lax.fori_loop(0, half, add_frequency, jnp.zeros_like(distance_BLS))
  compress_1H11 = jnp.asarray(8.0 * np.arange(1, num_heads + 1) / num_heads, jnp.float32)
  return total_BLS[:, None] / compress_1H11[None, :, None, None]


@register("sandwich")
class Sandwich(PosEnc):
  """Sandwich: bias_h(m, n) = (sum_{i=1}^{d'/2} cos((m - n) theta_i) - d'/2) / (8h / H).

  theta_i = 10000^(-2i/d') and d' = posenc.sandwich_dim (0 = model.emb_dim, the paper's
  choice: the inner product of the model's own sinusoidal embeddings). No parameters; cos is
  even, so the same bias serves encoders and decoders.
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    sandwich_dim: int = param(
      0,
      "dimension d' of the sinusoidal embeddings whose inner products form the bias (0 = "
      "model.emb_dim, as in the paper)",
    )

  # Its paper ran in the ALiBi paper's fairseq setup: tokens N(0, 1/d) times sqrt(d).
  paper_embed_scale = "sqrt_d"

  def __init__(self, cfg: PosEncConfig, *, emb_dim: int, **kwargs):
    super().__init__(cfg, emb_dim=emb_dim, **kwargs)
    self.dim = cfg.sandwich_dim or emb_dim

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if cfg.sandwich_dim < 0 or cfg.sandwich_dim == 1:
      raise ValueError(
        f"posenc.sandwich_dim={cfg.sandwich_dim} must be 0 (= model.emb_dim) or >= 2"
      )

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    return sandwich_bias(qpos_BL, kpos_BS, dim=self.dim, num_heads=self.num_heads)

  @classmethod
  def has_bias_factors(cls, *, causal: bool) -> bool:
    del causal
    return True

  def bias_factors(self, qpos_BL, kpos_BS):
    """cos((m - n) t) = cos(m t) cos(n t) + sin(m t) sin(n t), exactly the inner product of
    sinusoidal embeddings p_m . p_n the paper starts from; the -d'/2 is the same for every key.
    Query factor p_m / (8h / H) [B, L, H, d'], key factor p_n [B, S, 1, d'] (any GQA)."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    half = self.dim // 2
    inv_freq = jnp.asarray(10000.0 ** (-2.0 * np.arange(1, half + 1) / self.dim), jnp.float32)

    def sinusoids(pos_BL):
      angle_BLF = pos_BL.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
      return jnp.concatenate([jnp.cos(angle_BLF), jnp.sin(angle_BLF)], axis=-1)

    compress = 8.0 * np.arange(1, self.num_heads + 1) / self.num_heads
    compress_11H1 = jnp.asarray(compress, jnp.float32)[None, None, :, None]
    a_BLHR = sinusoids(qpos_BL)[:, :, None, :] / compress_11H1
    return a_BLHR, sinusoids(kpos_BS)[:, :, None, :]
