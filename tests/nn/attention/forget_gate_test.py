"""FoX's forget gate (model.forget_gate): the gate and the logit bias c_i - c_j by hand, every
kernel against the formula and the dense one (outputs and gradients), controls (gates of 1 are
no gate, gates near 0 leave each query its own key), parameters and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention import forget_gate, kernels
from roformer.nn.attention.call import AttentionCall

B, L, H, G, K, D = 2, 21, 4, 2, 8, 16
BLOCK = 4  # L = 21: six query blocks, the last one shifted; window 3 takes the banded path


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _inputs(seed=0):
  q, k = _normal((B, L, H, K), seed), _normal((B, L, G, K), seed + 1)
  logf = jax.nn.log_sigmoid(_normal((B, L, H), seed + 3) + 1.0)
  return q, k, _normal((B, L, G, K), seed + 2), logf


def _positions():
  return jnp.arange(L)[None, :] + jnp.array([[0], [100]])


def _segments():
  return (jnp.arange(L)[None, :] >= jnp.array([[12], [5]])).astype(jnp.int32)


def _by_hand(q, k, v, logf, seg, window):
  """softmax_j(q_i k_j / sqrt(K) + c_i - c_j) v_j over the visible keys, c the running sum of
  log f: the paper's bias with its per-query term, float64 loops."""
  q, k, v, seg = map(np.asarray, (q, k, v, seg))
  c = np.cumsum(np.asarray(logf, np.float64), axis=1)
  out = np.zeros(q.shape, np.float64)
  for b in range(B):
    for h in range(H):
      for i in range(L):
        keys = [
          j for j in range(i + 1) if seg[b, i] == seg[b, j] and (not window or i - j < window)
        ]
        z = np.array([q[b, i, h] @ k[b, j, h // (H // G)] / np.sqrt(K) + c[b, i, h] - c[b, j, h]
                      for j in keys])  # fmt: skip
        p = np.exp(z - z.max())
        out[b, i, h] = (p / p.sum()) @ v[b, keys, h // (H // G)]
  return out


def _kernel(impl, window):
  pos, seg = _positions(), _segments()

  def attend(q, k, v, logf):
    return kernels.KERNELS[impl](
      q,
      k,
      v,
      pos,
      pos,
      AttentionCall(
        qseg_BL=seg,
        kseg_BS=seg,
        causal=True,
        window=window,
        block=BLOCK,
        key_bias_BSH=-forget_gate.cumulative(logf),
      ),
    )

  return attend


@pytest.mark.parametrize("window", [0, 3])  # 3: the banded kernel
def test_every_kernel_matches_the_bias_c_i_minus_c_j_by_hand(window):
  q, k, v, logf = _inputs()
  want = _by_hand(q, k, v, logf, _segments(), window)
  for impl in ("dense", "chunked"):
    np.testing.assert_allclose(_kernel(impl, window)(q, k, v, logf), want, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("window", [0, 3])
def test_blockwise_kernels_equal_dense_forward_and_gradients(window):
  q, k, v, logf = _inputs()
  w = _normal(q.shape, 9)

  def grads(attend):
    return jax.grad(lambda *a: jnp.sum(w * attend(*a)), argnums=(0, 1, 2, 3))(q, k, v, logf)

  dense, chunked = _kernel("dense", window), _kernel("chunked", window)
  np.testing.assert_allclose(chunked(q, k, v, logf), dense(q, k, v, logf), atol=1e-5)
  for name, g, want in zip("q k v logf".split(), grads(chunked), grads(dense), strict=True):
    np.testing.assert_allclose(g, want, atol=1e-5, err_msg=name)
  assert np.abs(grads(dense)[3]).max() > 1e-2  # the gates get a gradient


def test_the_gate_is_a_log_sigmoid_of_the_input_and_c_its_running_sum():
  with nnx.use_eager_sharding(False):
    gate = forget_gate.ForgetGate(D, H, dtype=jnp.float32, param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(0))  # fmt: skip
  w, b = np.asarray(_normal((D, H), 1)), np.asarray(_normal((H,), 2))
  gate.proj.kernel[...], gate.proj.bias[...] = jnp.asarray(w), jnp.asarray(b)
  x = _normal((B, 5, D), 3)
  want = -np.log1p(np.exp(-(np.asarray(x) @ w + b)))  # log sigmoid
  np.testing.assert_allclose(gate(x), want, rtol=1e-5, atol=1e-6)
  c_prev = _normal((B, H), 4)
  np.testing.assert_allclose(
    forget_gate.cumulative(gate(x), c_prev), np.cumsum(want, axis=1) + np.asarray(c_prev)[:, None],
    rtol=1e-5, atol=1e-5,
  )  # fmt: skip


def _layers(gate_bias):
  """Two equal layers (same projections), the second with a forget gate of zero weights and the
  given bias: every gate is sigmoid(bias)."""
  with nnx.use_eager_sharding(False):
    plain, gated = (
      testing.attention_layer(
        emb_dim=D, num_heads=H, head_dim=K, num_kv_heads=G, attention_impl="chunked",
        attention_block=BLOCK, forget_gate=on,
      )
      for on in (False, True)
    )  # fmt: skip
  gated.forget_gate.proj.kernel[...] = jnp.zeros((D, H))
  gated.forget_gate.proj.bias[...] = jnp.full((H,), gate_bias)
  return plain, gated


def test_gates_of_one_are_no_gate_and_gates_near_zero_leave_each_query_its_own_key():
  x, pos = _normal((B, L, D), 5), testing.arange_positions(B, L)
  rope = testing.build_posenc("nope", num_heads=H, head_dim=K, emb_dim=D)
  plain, gated = _layers(40.0)  # log f = -4e-18: no decay
  np.testing.assert_allclose(gated(x, pos, rope)[0], plain(x, pos, rope)[0], atol=1e-6)
  _, gated = _layers(-40.0)  # each step back costs e^-40: only the query's own key counts
  _, _, v = gated.qkv(x)
  o = gated(x, pos, rope)[0]
  np.testing.assert_allclose(o, jnp.repeat(v, H // G, axis=2), atol=1e-6)
  assert np.abs(plain(x, pos, rope)[0] - o).max() > 0.1  # without the gate it mixes keys


def test_the_gate_is_a_parameter_per_layer_only_with_the_option():
  flat = {
    on: dict(nnx.to_flat_state(nnx.state(
      testing.random_model(testing.tiny_model_config("nope", forget_gate=on)), nnx.Param)))
    for on in (False, True)
  }  # fmt: skip
  added = set(flat[True]) - set(flat[False])
  cfg = testing.TINY_MODEL
  assert set(flat[False]) <= set(flat[True])
  assert added == {
    ("layers", i, "attn", "forget_gate", "proj", name)
    for i in range(cfg.num_layers)
    for name in ("kernel", "bias")
  }
  kernel = flat[True][("layers", 0, "attn", "forget_gate", "proj", "kernel")]
  bias = flat[True][("layers", 0, "attn", "forget_gate", "proj", "bias")]
  assert kernel.get_value().shape == (cfg.emb_dim, cfg.num_heads)
  assert kernel.get_metadata()["out_sharding"] == ("embed", "heads")
  assert bias.get_metadata()["out_sharding"] == ("heads",)


def test_the_gate_starts_as_the_papers_code_initialises_it():
  with nnx.use_eager_sharding(False):
    gate = forget_gate.ForgetGate(512, 64, dtype=jnp.float32, param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(0))  # fmt: skip
  w = np.asarray(gate.proj.kernel[...])
  assert abs(w.std() - forget_gate.GATE_INIT_STD) < 0.02 * forget_gate.GATE_INIT_STD
  np.testing.assert_array_equal(gate.proj.bias[...], 0.0)


@pytest.mark.parametrize(
  "fields, match",
  [
    (dict(kind="encoder", num_kv_heads=0), "needs a causal decoder"),
    (dict(attention_sinks=True), "cannot be combined"),
    (dict(attention="linear"), "model.forget_gate=True is implemented by softmax attention only"),
  ],
)
def test_refusals_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    testing.tiny_model_config("nope", forget_gate=True, **fields)
