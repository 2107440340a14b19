"""roformer/nn/layers.py: the fused building blocks equal what they replace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.nn import layers


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_swiglu_value_and_gradients_match_autodiff_of_silu():
  gate, up, w = _normal((64, 24), 0) * 3, _normal((64, 24), 1), _normal((64, 24), 2)

  def loss(fn):
    return lambda gate, up: jnp.sum(jnp.sin(fn(gate, up)) * w)

  np.testing.assert_allclose(layers.swiglu(gate, up), jax.nn.silu(gate) * up, rtol=1e-6, atol=1e-7)
  got = jax.grad(loss(layers.swiglu), argnums=(0, 1))(gate, up)
  want = jax.grad(loss(lambda g, u: jax.nn.silu(g) * u), argnums=(0, 1))(gate, up)
  for g, w_ in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-6)
  # Negative control: the gate's gradient without silu's second term is far off.
  s = jax.nn.sigmoid(gate)
  assert np.abs(got[0] - jnp.cos(jax.nn.silu(gate) * up) * w * up * s).max() > 0.1


@pytest.mark.parametrize("use_bias", [False, True])
def test_stacked_dense_equals_the_layers_one_by_one(use_bias):
  def build():
    return [
      nnx.Linear(6, 10, use_bias=use_bias, rngs=nnx.Rngs(i), bias_init=nnx.initializers.normal(1.0))
      for i in range(2)
    ]

  gate, up = build()
  x, w = _normal((5, 6), 3), _normal((2, 5, 10), 4)

  def loss(fn):
    def f(state, x):
      g, u = nnx.merge(graphdef, state)
      return jnp.sum(jnp.stack(fn((g, u), x)) * w)

    return f

  graphdef, state = nnx.split([gate, up])
  one_by_one = loss(lambda pair, x: [layer(x) for layer in pair])
  stacked = loss(lambda pair, x: layers.stacked_dense(x, pair))
  np.testing.assert_allclose(stacked(state, x), one_by_one(state, x), rtol=1e-6)
  got = jax.grad(stacked, argnums=(0, 1))(state, x)
  want = jax.grad(one_by_one, argnums=(0, 1))(state, x)
  for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-6)
  # The outputs come back in the layers' order.
  g_out, u_out = layers.stacked_dense(x, (gate, up))
  np.testing.assert_allclose(g_out, gate(x), rtol=1e-6)
  np.testing.assert_allclose(u_out, up(x), rtol=1e-6)


def test_shared_input_dense_value_and_gradients_match_autodiff_of_the_products():
  x = _normal((12, 6), 5)
  kernels = (_normal((6, 4), 6), _normal((6, 10), 7), _normal((6, 4), 8))
  ws = tuple(_normal((12, k.shape[1]), 9 + i) for i, k in enumerate(kernels))

  def loss(fn):
    return lambda x, kernels: sum(
      jnp.sum(jnp.sin(y) * w) for y, w in zip(fn(x, kernels), ws, strict=True)
    )

  plain = loss(lambda x, kernels: [x @ k for k in kernels])
  shared = loss(layers.shared_input_dense)
  for y, k in zip(layers.shared_input_dense(x, kernels), kernels, strict=True):
    np.testing.assert_allclose(y, x @ k, rtol=1e-6, atol=1e-6)
  got = jax.grad(shared, argnums=(0, 1))(x, kernels)
  want = jax.grad(plain, argnums=(0, 1))(x, kernels)
  for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-5)
  # Negative control: the input's gradient from the first product alone is far off.
  first_only = loss(lambda x, ks: [x @ ks[0], *(jax.lax.stop_gradient(x @ k) for k in ks[1:])])
  one = jax.grad(first_only)(x, kernels)
  assert np.abs(got[0] - one).max() > 0.1
  # Under jit the transposed input is kept: no weight gradient contracts the tokens as the
  # major axis of both operands, as autodiff of the plain products does (the control).
  tn = "lhs_contracting_dims={0}, rhs_contracting_dims={0}"
  for fn, has_tn in ((shared, False), (plain, True)):
    hlo = jax.jit(jax.grad(fn, argnums=1)).lower(x, kernels).compile().as_text()
    assert (tn in hlo) == has_tn
