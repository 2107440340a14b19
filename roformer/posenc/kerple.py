"""KERPLE (Chi et al. 2022), logarithmic variant: a learned per-head log decay of distance."""

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig
from roformer.posenc.registry import register

# The paper's code clamps r1 and r2 to at least this, in place, before every forward pass, and
# trains the clamped values. Here the forward pass reads max(r, EPS) with the gradient of r (a
# clamp that never blocks the gradient, unlike jnp.maximum, whose gradient below EPS is 0 and would
# freeze the parameter for good), and `Kerple.constrain`, which the train step calls after every
# update, writes the clamp into the parameters as the paper's code does.
KERPLE_EPS = 1e-2


def clamp_trainable(r, eps: float = KERPLE_EPS):
  """max(r, eps) in the forward pass, with the gradient of r itself (straight through)."""
  r = r.astype(jnp.float32)
  return r + jax.lax.stop_gradient(jnp.maximum(r, eps) - r)


def kerple_log_bias(qpos_BL, kpos_BS, r1_H, r2_H):
  """-r1_h log(1 + r2_h |m - n|), float32 [B, H, L, S], with r1 and r2 clamped to >= KERPLE_EPS."""
  distance_BLS = jnp.abs(qpos_BL[:, :, None] - kpos_BS[:, None, :]).astype(jnp.float32)
  r1_1H11 = clamp_trainable(r1_H)[None, :, None, None]
  r2_1H11 = clamp_trainable(r2_H)[None, :, None, None]
  return -r1_1H11 * jnp.log1p(r2_1H11 * distance_BLS[:, None])


@register("kerple")
class Kerple(PosEnc):
  """KERPLE-log: bias_h(m, n) = -r1_h log(1 + r2_h |m - n|), r1_h, r2_h > 0 learned per head.

  Initialisation as the paper's code: r1 ~ U(0, 2), r2 ~ U(0, 1), both kept >= 0.01 and
  trainable at the clamp (`clamp_trainable`, `constrain`). The
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
    self.constrain()  # the paper's code clamps before its first forward pass too

  def constrain(self) -> None:
    """Clamps r1 and r2 to >= KERPLE_EPS in place (the paper's code does so every step)."""
    for r in (self.r1, self.r2):
      r[...] = jnp.maximum(r[...], jnp.asarray(KERPLE_EPS, r[...].dtype))

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    return kerple_log_bias(qpos_BL, kpos_BS, self.r1[...], self.r2[...])
