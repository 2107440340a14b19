"""KERPLE (Chi et al. 2022), logarithmic variant: a learned per-head log decay of distance."""

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc_config import PosEncConfig

# The paper's code clamps r1 and r2 to at least this after every update; the forward pass here
# takes max(r, EPS) instead, which gives the same biases without touching the parameters.
KERPLE_EPS = 1e-2


def kerple_log_bias(qpos_BL, kpos_BS, r1_H, r2_H):
  """-r1_h log(1 + r2_h |m - n|), float32 [B, H, L, S], with r1 and r2 clamped to >= KERPLE_EPS."""
  distance_BLS = jnp.abs(qpos_BL[:, :, None] - kpos_BS[:, None, :]).astype(jnp.float32)
  r1_1H11 = jnp.maximum(r1_H.astype(jnp.float32), KERPLE_EPS)[None, :, None, None]
  r2_1H11 = jnp.maximum(r2_H.astype(jnp.float32), KERPLE_EPS)[None, :, None, None]
  return -r1_1H11 * jnp.log1p(r2_1H11 * distance_BLS[:, None])


class Kerple(PosEnc):
  """KERPLE-log: bias_h(m, n) = -r1_h log(1 + r2_h |m - n|), r1_h, r2_h > 0 learned per head.

  Initialisation as the paper's code: r1 ~ U(0, 2), r2 ~ U(0, 1), both kept >= 0.01. The
  parameters are 1-D, so weight decay never applies to them. One pair per head serves every
  layer (the encoding is one module per model, as T5's table). A decoder sees only keys before
  the query, where |m - n| = m - n; an encoder gets the same symmetric form.
  """

  def __init__(self, cfg: PosEncConfig, *, num_heads: int, rngs: nnx.Rngs, **kwargs):
    super().__init__(cfg, num_heads=num_heads, rngs=rngs, **kwargs)

    def uniform(high):
      def init(key, shape, dtype):
        return jax.random.uniform(key, shape, dtype, 0.0, high)

      return nnx.with_partitioning(init, ("heads",))

    self.r1 = nnx.Param(uniform(2.0)(rngs.params(), (num_heads,), self.param_dtype))
    self.r2 = nnx.Param(uniform(1.0)(rngs.params(), (num_heads,), self.param_dtype))

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    return kerple_log_bias(qpos_BL, kpos_BS, self.r1[...], self.r2[...])
