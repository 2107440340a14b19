"""Attention sinks (model.attention_sinks): gpt-oss's formula by hand, the dense kernel's
hand-written gradient against autodiff of a plain reference, the blockwise kernels against the
dense one, and controls (a -inf-like sink is no sink, a large one empties the output)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention import kernels, sinks
from roformer.nn.attention.call import AttentionCall

B, L, H, G, K = 2, 21, 4, 2, 8
BLOCK = 4  # L = 21: six query blocks, the last one shifted; window 3 takes the banded path


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _inputs(length=L, seed=0):
  q, k = _normal((B, length, H, K), seed), _normal((B, length, G, K), seed + 1)
  return q, k, _normal((B, length, G, K), seed + 2), _normal((H,), seed + 3)


def _positions(length=L):
  return jnp.arange(length)[None, :] + jnp.array([[0], [100]])


def _segments(length=L):
  return (jnp.arange(length)[None, :] >= jnp.array([[12], [5]])).astype(jnp.int32)


def _position_bias(qpos_BL, kpos_BS):
  h_1H11 = jnp.arange(H)[None, :, None, None]
  return jnp.sin(0.3 * qpos_BL[:, None, :, None] - 0.7 * kpos_BS[:, None, None, :] + h_1H11)


def _by_hand(q, k, v, sink, pos, seg, window):
  """p_j = exp(z_j) / (exp(s_h) + sum_k exp(z_k)) over the visible keys, o = sum_j p_j v_j,
  causal self-attention, float64 loops."""
  q, k, v, sink, pos, seg = map(np.asarray, (q, k, v, sink, pos, seg))
  bias = np.asarray(_position_bias(jnp.asarray(pos), jnp.asarray(pos)))
  out = np.zeros(q.shape, np.float64)
  rep = H // G
  for b in range(B):
    for h in range(H):
      for i in range(q.shape[1]):
        keys = [
          j
          for j in range(i + 1)
          if seg[b, i] == seg[b, j] and (window == 0 or pos[b, i] - pos[b, j] < window)
        ]
        z = np.array([q[b, i, h] @ k[b, j, h // rep] / np.sqrt(K) + bias[b, h, i, j] for j in keys])
        m = max(z.max(), sink[h])
        p = np.exp(z - m) / (np.exp(sink[h] - m) + np.exp(z - m).sum())
        out[b, i, h] = p @ v[b, keys, h // rep]
  return out


def test_one_query_two_keys_by_hand():
  # z = q k / sqrt(1) = [2, -2] and exp(s) = 2: o = (3 e^2 + 5 e^-2) / (2 + e^2 + e^-2).
  q = jnp.full((1, 1, 1, 1), 2.0)
  k = jnp.asarray([1.0, -1.0]).reshape(1, 2, 1, 1)
  v = jnp.asarray([3.0, 5.0]).reshape(1, 2, 1, 1)
  qpos, kpos = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 2), jnp.int32)
  e = math.e
  want = (3 * e**2 + 5 * e**-2) / (2 + e**2 + e**-2)
  for impl in ("dense", "chunked"):
    got = kernels.KERNELS[impl](
      q, k, v, qpos, kpos, AttentionCall(sink_H=jnp.asarray([math.log(2.0)]), block=1)
    )
    np.testing.assert_allclose(float(got[0, 0, 0, 0]), want, rtol=1e-6)


@pytest.mark.parametrize("window", [0, 3])  # 3: the banded kernel (chunked_attention hands it on)
def test_every_kernel_matches_the_formula_by_hand(window, monkeypatch):
  q, k, v, sink = _inputs()
  pos, seg = _positions(), _segments()
  want = _by_hand(q, k, v, sink, pos, seg, window)
  kwargs = dict(qseg_BL=seg, kseg_BS=seg, causal=True, window=window, bias_fn=_position_bias,
                block=BLOCK, sink_H=sink)  # fmt: skip
  for impl in ("dense", "chunked"):
    got = kernels.KERNELS[impl](q, k, v, pos, pos, AttentionCall(**kwargs))
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=impl)
  monkeypatch.setattr(kernels.dense, "CAUSAL_QUERY_BLOCK", 8)  # the dense kernel in 3 query blocks
  got = kernels.dense_attention(q, k, v, pos, pos, AttentionCall(**kwargs))
  np.testing.assert_allclose(got, want, atol=1e-5)


def _reference(q, k, v, pos, seg, sink, window=0):
  """Hugging Face's gpt-oss eager attention in jnp: the sink a last column of the masked logits,
  a plain softmax, the column dropped. Differentiated by JAX's autodiff."""
  rep = H // G
  k_BSHK, v_BSHK = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  z_BHLS = jnp.einsum("blhk,bshk->bhls", q, k_BSHK) / math.sqrt(K) + _position_bias(pos, pos)
  d_BLS = pos[:, :, None] - pos[:, None, :]
  visible_BLS = (d_BLS >= 0) & (seg[:, :, None] == seg[:, None, :])
  if window:
    visible_BLS &= d_BLS < window
  z_BHLS = jnp.where(visible_BLS[:, None], z_BHLS, -jnp.inf)
  sink_BHL1 = jnp.broadcast_to(sink[None, :, None, None], z_BHLS.shape[:3] + (1,))
  p_BHLS = jax.nn.softmax(jnp.concatenate([z_BHLS, sink_BHL1], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bhls,bshk->blhk", p_BHLS, v_BSHK)


def _grads(attend, q, k, v, sink):
  w = _normal(q.shape, 9)  # a loss whose gradient do differs in every element

  def loss(q, k, v, sink):
    return jnp.sum(w * attend(q, k, v, sink))

  return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink)


@pytest.mark.parametrize("query_block", [0, 8])  # 8: the dense kernel in 3 query blocks
def test_dense_gradients_equal_autodiff_of_the_reference(query_block, monkeypatch):
  if query_block:
    monkeypatch.setattr(kernels.dense, "CAUSAL_QUERY_BLOCK", query_block)
  q, k, v, sink = _inputs()
  pos, seg = _positions(), _segments()
  kwargs = dict(qseg_BL=seg, kseg_BS=seg, causal=True, bias_fn=_position_bias)

  def attend(q, k, v, sink):
    return kernels.dense_attention(q, k, v, pos, pos, AttentionCall(sink_H=sink, **kwargs))

  got = _grads(attend, q, k, v, sink)
  want = _grads(lambda *a: _reference(*a[:3], pos, seg, a[3]), q, k, v, sink)
  for name, g, w in zip("q k v sink".split(), got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)
  assert np.abs(got[3]).min() > 1e-3  # the sink's gradient is not trivially zero


def test_sink_gradient_is_minus_p_sink_times_do_dot_o():
  # d loss / d s_h = -sum over batch and rows of p_sink (do . o), with p_sink by hand.
  q, k, v, sink = _inputs()
  pos, seg = _positions(), _segments()
  w = _normal(q.shape, 9)

  def attend(sink):
    return kernels.dense_attention(
      q,
      k,
      v,
      pos,
      pos,
      AttentionCall(qseg_BL=seg, kseg_BS=seg, causal=True, bias_fn=_position_bias, sink_H=sink),
    )

  got = jax.grad(lambda s: jnp.sum(w * attend(s)))(sink)
  o = np.asarray(attend(sink), np.float64)
  bias = np.asarray(_position_bias(pos, pos))
  z = np.einsum("blhk,bshk->bhls", np.asarray(q), np.repeat(np.asarray(k), H // G, 2)) / np.sqrt(K)
  z = z + bias
  visible = (np.asarray(pos)[:, :, None] >= np.asarray(pos)[:, None, :]) & (
    np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :]
  )
  z = np.where(visible[:, None], z, -np.inf)
  s = np.asarray(sink, np.float64)[None, :, None]
  p_sink = np.exp(s) / (np.exp(s) + np.exp(z).sum(-1))  # [B, H, L]
  do_dot_o = np.einsum("blhk,blhk->bhl", np.asarray(w, np.float64), o)
  np.testing.assert_allclose(got, -(p_sink * do_dot_o).sum(axis=(0, 2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [0, 3])
def test_blockwise_kernels_equal_dense_forward_and_gradients(window):
  q, k, v, sink = _inputs()
  pos, seg = _positions(), _segments()

  def kernel(impl):
    kwargs = dict(qseg_BL=seg, kseg_BS=seg, causal=True, window=window, bias_fn=_position_bias,
                  block=BLOCK)  # fmt: skip
    return lambda q, k, v, s: kernels.KERNELS[impl](
      q, k, v, pos, pos, AttentionCall(sink_H=s, **kwargs)
    )

  np.testing.assert_allclose(kernel("chunked")(q, k, v, sink), kernel("dense")(q, k, v, sink),
                             atol=1e-5)  # fmt: skip
  got, want = _grads(kernel("chunked"), q, k, v, sink), _grads(kernel("dense"), q, k, v, sink)
  for name, g, w in zip("q k v sink".split(), got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)
  want = _grads(lambda *a: _reference(*a[:3], pos, seg, a[3], window), q, k, v, sink)
  np.testing.assert_allclose(got[3], want[3], atol=1e-5)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_dropout_path_keeps_the_sink(impl):
  # At a rate of 1e-7 this key drops nothing, so the dropout path (the dense kernel's plain
  # softmax, the chunked kernel's dropped block probabilities) must give the formula's output.
  q, k, v, sink = _inputs()
  pos, seg = _positions(), _segments()
  got = kernels.KERNELS[impl](
    q,
    k,
    v,
    pos,
    pos,
    AttentionCall(
      qseg_BL=seg,
      kseg_BS=seg,
      causal=True,
      bias_fn=_position_bias,
      block=BLOCK,
      sink_H=sink,
      dropout_rate=1e-7,
      dropout_key=jax.random.PRNGKey(0),
    ),
  )
  np.testing.assert_allclose(got, _by_hand(q, k, v, sink, pos, seg, 0), atol=1e-5)


@pytest.mark.parametrize("impl, window", [("dense", 0), ("chunked", 0), ("chunked", 3)])
def test_a_minus_infinity_like_sink_is_no_sink_and_a_large_one_empties_the_output(impl, window):
  q, k, v, _ = _inputs()
  pos, seg = _positions(), _segments()
  kwargs = dict(qseg_BL=seg, kseg_BS=seg, causal=True, window=window, bias_fn=_position_bias,
                block=BLOCK)  # fmt: skip

  def run(sink, q=q, k=k, v=v):
    return kernels.KERNELS[impl](q, k, v, pos, pos, AttentionCall(sink_H=sink, **kwargs))

  def grads(sink):  # of q, k and v, the sink held fixed
    return _grads(lambda q, k, v, _: run(sink, q, k, v), q, k, v, jnp.zeros((H,)))[:3]

  plain = np.asarray(run(None))
  np.testing.assert_allclose(run(jnp.full((H,), -1e30)), plain, atol=1e-6)
  for g, w in zip(grads(jnp.full((H,), -1e30)), grads(None), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-6)
  # Raising the sink moves weight from every key to it: each row shrinks towards zero.
  norms = [np.linalg.norm(run(jnp.full((H,), s)), axis=-1) for s in (-2.0, 2.0, 40.0)]
  assert (norms[1] < norms[0]).all() and (norms[2] < 1e-8 * np.linalg.norm(plain, axis=-1)).all()


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_a_query_with_no_visible_key_gives_zeros_and_no_sink_gradient(impl):
  # Cross-attention whose keys all come after query 0: its row sees nothing, row 1 sees key 0.
  q, k, v, sink = _normal((1, 2, H, K), 0), _normal((1, 3, G, K), 1), _normal((1, 3, G, K), 2), \
    _normal((H,), 3)  # fmt: skip
  qpos, kpos = jnp.asarray([[0, 5]]), jnp.asarray([[3, 6, 9]])

  def attend(sink):
    return kernels.KERNELS[impl](
      q, k, v, qpos, kpos, AttentionCall(causal=True, block=2, sink_H=sink)
    )

  o = attend(sink)
  np.testing.assert_array_equal(o[0, 0], 0.0)
  assert np.abs(o[0, 1]).min() > 0.0
  grad_row0 = jax.grad(lambda s: jnp.sum(attend(s)[0, 0]))(sink)
  np.testing.assert_array_equal(grad_row0, 0.0)
  assert np.isfinite(jax.grad(lambda s: jnp.sum(attend(s)))(sink)).all()


def test_the_sinks_are_a_parameter_per_head_only_with_the_option():
  with nnx.use_eager_sharding(False):
    params = {
      on: nnx.state(testing.random_model(testing.tiny_model_config(attention_sinks=on)), nnx.Param)
      for on in (False, True)
    }
  flat = {on: dict(nnx.to_flat_state(p)) for on, p in params.items()}
  added = set(flat[True]) - set(flat[False])
  cfg = testing.TINY_MODEL
  assert added == {("layers", i, "attn", "sinks") for i in range(cfg.num_layers)}
  assert set(flat[False]) <= set(flat[True])
  sink = flat[True][("layers", 0, "attn", "sinks")]
  assert sink.get_value().shape == (cfg.num_heads,)
  assert sink.get_metadata()["out_sharding"] == ("heads",)


def test_sinks_start_as_gpt_oss_initialises_them():
  with nnx.use_eager_sharding(False):
    s = sinks.sink_param(20000, jnp.float32, nnx.Rngs(0)).get_value()
  assert abs(float(s.std()) - sinks.SINK_INIT_STD) < 0.02 * sinks.SINK_INIT_STD
  assert abs(float(s.mean())) < 3 * sinks.SINK_INIT_STD / math.sqrt(20000)


@pytest.mark.parametrize("attention", ["linear", "mla"])
def test_other_attention_kinds_refuse_the_sinks_naming_the_field(attention):
  fields = dict(kv_lora_rank=8, qk_rope_head_dim=4, num_kv_heads=0) if attention == "mla" else {}
  with pytest.raises(ValueError, match="model.attention_sinks=True is implemented by softmax"):
    testing.tiny_model_config(attention=attention, attention_sinks=True, **fields)
