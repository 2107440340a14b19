"""The online softmax's block max (`primitives.row_max`): differentiated as `jnp.max`, and finite
where XLA's copies of the logits round differently (XLA:CPU at backend optimisation level 0)."""

import jax
import jax.numpy as jnp
import numpy as np

from roformer.nn.attention import kernels
from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.primitives import NEG, row_max

B, L, H, G, K = 1, 16, 2, 1, 8
BLOCK = 8  # the key block after the first query block is skipped (causal)


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_row_max_derivative_is_jnp_max_derivative_ties_included():
  s = jnp.array([[1.0, 3.0, 3.0, 2.0], [0.5, -1.0, 0.25, 0.0], [NEG, NEG, NEG, NEG]])
  t = _normal(s.shape, 0)
  want_m, want_t = jax.jvp(lambda x: x.max(axis=-1), (s,), (t,))
  got_m, got_t = jax.jvp(row_max, (s,), (t,))
  np.testing.assert_array_equal(got_m, want_m)
  np.testing.assert_array_equal(got_t, want_t)  # row 0: (t1 + t2) / 2; row 2: the mean


def test_chunked_gradients_finite_at_backend_optimization_level_0():
  # With a bias, XLA:CPU at level 0 rounds q.k / sqrt(K) + bias as one FMA in some of the kernels
  # that recompute it and as a multiply and an add in others, so a row's max can equal none of
  # its recomputed logits; jnp.max's derivative then divides by zero ties (inf, then NaN).
  q, k, v = _normal((B, L, H, K), 1), _normal((B, L, G, K), 2), _normal((B, L, G, K), 3)
  bias_H = _normal((H,), 4)
  pos = jnp.arange(L)[None, :]

  def loss(q, k, v, bias_H):
    def bias_fn(qpos_BL, kpos_BS):
      shape = (qpos_BL.shape[0], H, qpos_BL.shape[1], kpos_BS.shape[1])
      return jnp.broadcast_to(bias_H[None, :, None, None], shape)

    call = AttentionCall(causal=True, block=BLOCK, bias_fn=bias_fn)
    o = kernels.chunked_attention(q, k, v, pos, pos, call)
    return jnp.sum(o * jnp.sin(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape)))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  level0 = grads.lower(q, k, v, bias_H).compile({"xla_backend_optimization_level": 0})
  for got, want in zip(level0(q, k, v, bias_H), grads(q, k, v, bias_H), strict=True):
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5)
