"""roformer/nn/attention/kernels/ (dense, chunked, auto): what the conformance test against the
oracle does not reach: the dense kernel's causal query blocks, the layer's GQA/MQA, dropout,
memory and the hand-written softmax backward; and the oracle itself against a naive loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention import block_pairs, blocks
from roformer.nn.attention import kernels as attention
from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.kernels import cpu_flash, dense
from roformer.nn.attention.oracle import reference_attention
from roformer.nn.attention.primitives import NEG
from roformer.posenc import make_posenc
from roformer.posenc.config import PosEncConfig, RopeScaling

B, L, H, G, K = 2, 37, 4, 2, 8  # L is not a multiple of BLOCK
BLOCK = 8


def _normal(shape, seed, dtype=jnp.float32):
  # numpy draws: no random-number program to compile in every test.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkv(seed=0, length=L, num_kv_heads=G, head_dim=K):
  q = _normal((B, length, H, head_dim), seed)
  k = _normal((B, length, num_kv_heads, head_dim), seed + 1)
  v = _normal((B, length, num_kv_heads, head_dim), seed + 2)
  return q, k, v


def _positions(length=L):
  # Row 1 starts at 100: kernels must use the given positions, not indices.
  return jnp.arange(length)[None, :] + jnp.array([[0], [100]])


def _segments(length=L):
  # Two documents per row, split at different places; positions need not restart for the mask.
  return (jnp.arange(length)[None, :] >= jnp.array([[20], [9]])).astype(jnp.int32)


def _posenc(kind, causal, scaling=None):
  cfg = PosEncConfig(kind=kind, max_len=256, scaling=scaling or RopeScaling())
  with nnx.use_eager_sharding(False):  # no mesh in these tests
    return make_posenc(
      cfg, num_heads=H, head_dim=K, emb_dim=H * K, causal=causal, num_kv_heads=G, rngs=nnx.Rngs(3)
    )


def _naive_attention(q, k, v, qpos, kpos, seg, causal, window, bias):
  q, k, v, qpos, kpos, seg, bias = map(np.asarray, (q, k, v, qpos, kpos, seg, bias))
  out = np.zeros(q.shape, np.float64)
  rep = q.shape[2] // k.shape[2]
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      for i in range(q.shape[1]):
        allowed = [
          j
          for j in range(k.shape[1])
          if seg[b, i] == seg[b, j]
          and (not causal or kpos[b, j] <= qpos[b, i])
          and (window == 0 or abs(qpos[b, i] - kpos[b, j]) < window)
        ]
        logits = np.array(
          [q[b, i, h] @ k[b, j, h // rep] / np.sqrt(q.shape[3]) + bias[b, h, i, j] for j in allowed]
        )
        p = np.exp(logits - logits.max())
        out[b, i, h] = (p / p.sum()) @ v[b, allowed, h // rep]
  return out


def _position_bias(qpos_BL, kpos_BS):
  # Depends on both positions and the head: a block of it is right only if taken at its positions.
  h_1H11 = jnp.arange(H)[None, :, None, None]
  return jnp.sin(0.3 * qpos_BL[:, None, :, None] - 0.7 * kpos_BS[:, None, None, :] + h_1H11)


@pytest.mark.parametrize("query_block", [0, 3])  # 0: the default, one block at this length
@pytest.mark.parametrize("causal", [True, False])
def test_dense_matches_naive_loop_with_segments_window_and_bias(causal, query_block, monkeypatch):
  if query_block:  # causal self-attention in query blocks [0, 3), [3, 6), [6, 9), [9, 11)
    monkeypatch.setattr(dense, "CAUSAL_QUERY_BLOCK", query_block)
  length = 11
  q, k, v = _qkv(length=length)
  pos, seg = _positions(length), _segments(length)
  got = attention.dense_attention(
    q,
    k,
    v,
    pos,
    pos,
    AttentionCall(qseg_BL=seg, kseg_BS=seg, causal=causal, window=4, bias_fn=_position_bias),
  )
  want = _naive_attention(q, k, v, pos, pos, seg, causal, 4, _position_bias(pos, pos))
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_oracle_matches_naive_loop_with_segments_window_and_bias(causal):
  """The oracle every kernel is held to (conformance_test.py), against plain numpy loops."""
  length = 11
  q, k, v = _qkv(length=length)
  pos, seg = _positions(length), _segments(length)
  call = AttentionCall(qseg_BL=seg, kseg_BS=seg, causal=causal, window=4, bias_fn=_position_bias)
  got = reference_attention(q, k, v, pos, pos, call)
  want = _naive_attention(q, k, v, pos, pos, seg, causal, 4, _position_bias(pos, pos))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_causal_query_blocks_cover_the_rows_and_stop_the_keys_at_the_block_end():
  assert dense.causal_query_blocks(100) == [(0, 100, 100)]
  assert dense.causal_query_blocks(300) == [(0, 100, 100), (100, 200, 200), (200, 300, 300)]
  assert dense.causal_query_blocks(512) == [(s, s + 128, s + 128) for s in range(0, 512, 128)]
  assert dense.causal_query_blocks(4096) == [(s, s + 512, s + 512) for s in range(0, 4096, 512)]


def test_dense_causal_blocks_give_the_unsplit_gradients(monkeypatch):
  q, k, v = _qkv()
  pos, seg = _positions(), _segments()

  def grads():
    def loss(q, k, v):
      o = attention.dense_attention(
        q,
        k,
        v,
        pos,
        pos,
        AttentionCall(qseg_BL=seg, kseg_BS=seg, causal=True, bias_fn=_position_bias),
      )
      return jnp.sum(jnp.sin(o))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  want = grads()  # L = 37: one block
  monkeypatch.setattr(dense, "CAUSAL_QUERY_BLOCK", 8)  # 5 blocks
  for g, w in zip(grads(), want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5)


def test_dense_causal_blocks_skip_later_keys_by_index(monkeypatch):
  # Positions that run backwards break the contract (they advance within a segment): by
  # position, query 0 (the highest) may see every key; by block it sees keys [0, 3) only. The
  # outputs differ, which shows the later keys are really skipped.
  monkeypatch.setattr(dense, "CAUSAL_QUERY_BLOCK", 3)
  q, k, v = _qkv(length=9)
  pos = jnp.broadcast_to(jnp.arange(9)[::-1], (B, 9))
  got = attention.dense_attention(q, k, v, pos, pos, AttentionCall(causal=True))
  q3, k3, v3, pos3 = q[:, :3], k[:, :3], v[:, :3], pos[:, :3]
  first = attention.dense_attention(q3, k3, v3, pos3, pos3, AttentionCall(causal=True))
  np.testing.assert_allclose(got[:, :3], first, atol=1e-6)
  monkeypatch.setattr(dense, "CAUSAL_QUERY_BLOCK", 9)  # one block: every key by position
  unsplit = attention.dense_attention(q, k, v, pos, pos, AttentionCall(causal=True))
  assert np.abs(unsplit[:, :3] - first).max() > 1e-2


def _layer(num_kv_heads, impl="dense", seed=0, dtype=jnp.float32):
  """An Attention layer with random values (from numpy, biases included) in every parameter."""

  def build():
    return testing.attention_layer(
      emb_dim=H * K, num_heads=H, head_dim=K, num_kv_heads=num_kv_heads, attention_impl=impl,
      attention_block=BLOCK, dtype=jnp.dtype(dtype).name,
    )  # fmt: skip

  with nnx.use_eager_sharding(False):  # no mesh in these tests
    graphdef, state = nnx.split(nnx.eval_shape(build))
  rng = np.random.default_rng(seed)

  def fill(x):
    fan_in = H * K if x.ndim == 3 else 1  # kernels [D, H, K] and [H, K, D] both have H * K = D
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(fan_in), x.dtype)

  return nnx.merge(graphdef, jax.tree.map(fill, state))


@jax.jit
def _apply(layers, x, pos, posenc):
  return [_attention_output(layer, x, pos, posenc) for layer in layers]


def _attention_output(layer, x, pos, posenc, **kwargs):
  """The layer's heads through its output projection: [B, L, D]."""
  o_BLHK, cache = layer(x, pos, posenc, **kwargs)
  assert cache is None  # no cache in, none out
  return layer.out(o_BLHK)


def test_gqa_equals_mha_with_key_value_heads_repeated_per_group():
  x = _normal((B, L, H * K), 10)
  gqa, mha = _layer(G), _layer(H)
  mha.query = gqa.query
  mha.out = gqa.out
  # Query head h reads key/value head h // (H // G).
  for name in ("key", "value"):
    getattr(mha, name).kernel[...] = jnp.repeat(getattr(gqa, name).kernel[...], H // G, axis=1)
    getattr(mha, name).bias[...] = jnp.repeat(getattr(gqa, name).bias[...], H // G, axis=0)
  got, want = _apply([gqa, mha], x, _positions(), _posenc("rope", causal=True))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_mha_layer_matches_naive_loop():
  length = 9
  x = _normal((B, length, H * K), 10)
  pos = _positions(length)
  posenc = _posenc("alibi", causal=True)
  layer = _layer(H)
  q, k, v = layer.qkv(x)
  o = _naive_attention(q, k, v, pos, pos, jnp.zeros((B, length)), True, 0, posenc.bias(pos, pos))
  want = np.einsum("blhk,hkd->bld", o, layer.out.kernel[...]) + layer.out.bias[...][None, None]
  (got,) = _apply([layer], x, pos, posenc)
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_mqa_chunked_matches_dense():
  x = _normal((B, L, H * K), 10)
  dense, chunked = _layer(1, "dense"), _layer(1, "chunked")
  assert dense.key.kernel.shape == (H * K, 1, K)
  want, got = _apply([dense, chunked], x, _positions(), _posenc("t5", causal=True))
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", ["t5", pytest.param("rope", marks=pytest.mark.slow)])
def test_chunked_gradients_match_dense(kind):
  x = _normal((B, L, H * K), 10)
  pos, seg = _positions(), _segments()

  @jax.jit
  def grads(layers, posenc, x):
    def loss(layer, posenc, x):
      y = _attention_output(layer, x, pos, posenc, segment_ids_BL=seg)
      return jnp.sum(y * jnp.sin(jnp.arange(y.size).reshape(y.shape)))

    return [jax.grad(loss, argnums=(0, 1, 2))(layer, posenc, x) for layer in layers]

  dense, chunked = grads([_layer(G, "dense"), _layer(G, "chunked")], _posenc(kind, True), x)
  flat_dense, flat_chunked = jax.tree.leaves(dense), jax.tree.leaves(chunked)
  assert len(flat_dense) == len(flat_chunked) >= 9  # q/k/v/out kernels and biases (+ t5 table), x
  for want, got in zip(flat_dense, flat_chunked, strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(jnp.abs(want).max())))


def test_auto_picks_dense_for_short_and_chunked_for_long_inputs(monkeypatch):
  """Without the fused CPU kernel (which auto prefers on a CPU, at any length)."""
  q, k, v = _qkv()
  pos = _positions()

  def auto(q, block):
    return attention.auto_attention(q, k, v, pos, pos, AttentionCall(causal=True, block=block))

  assert "scan" not in str(jax.make_jaxpr(auto, static_argnums=1)(q, 8))  # cpu_flash
  assert "ffi_call" in str(jax.make_jaxpr(auto, static_argnums=1)(q, 8))
  monkeypatch.setattr(cpu_flash, "unavailable", lambda: "not built")
  auto = functools.partial(auto)  # traced anew, not from the cache of the calls above
  assert "scan" not in str(jax.make_jaxpr(auto, static_argnums=1)(q, 64))
  assert "scan" in str(jax.make_jaxpr(auto, static_argnums=1)(q, 8))


@pytest.mark.parametrize("kernel", [attention.dense_attention, attention.chunked_attention])
def test_attention_dropout_scales_kept_probabilities_and_keeps_denominator(kernel):
  # With one-hot values (v[s] = e_s) the output row is the (dropped) probability vector itself.
  length, rate = 24, 0.5
  q, k, _ = _qkv(length=length, head_dim=length)
  v = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (B, length, G, length))
  pos = _positions(length)

  @jax.jit
  def run(key):
    kwargs = dict(causal=True, block=BLOCK)
    probs = attention.dense_attention(q, k, v, pos, pos, AttentionCall(**kwargs))
    return probs, kernel(
      q, k, v, pos, pos, AttentionCall(dropout_rate=rate, dropout_key=key, **kwargs)
    )

  probs, dropped = run(jax.random.key(5))
  kept, allowed = dropped != 0, probs != 0
  np.testing.assert_allclose(
    jnp.where(kept, dropped, 0), jnp.where(kept, probs / (1 - rate), 0), rtol=1e-5
  )
  assert not jnp.any(kept & ~allowed)
  assert 0.4 < float(kept.sum() / allowed.sum()) < 0.6
  # Independent masks for different key blocks and query blocks (all allowed under the mask).
  assert jnp.any(kept[:, 16:24, :, 0:8] != kept[:, 16:24, :, 8:16])
  assert jnp.any(kept[:, 8:16, :, 0:8] != kept[:, 16:24, :, 0:8])
  np.testing.assert_array_equal(run(jax.random.key(5))[1], dropped)
  assert jnp.any(run(jax.random.key(6))[1] != dropped)


@pytest.mark.slow
def test_bfloat16_compute_stays_close_to_float32():
  x = _normal((B, L, H * K), 10)
  f32 = _layer(G, "chunked")
  bf16 = _layer(G, "chunked", dtype=jnp.bfloat16)
  assert bf16.query.kernel[...].dtype == jnp.float32
  want, got = _apply([f32, bf16], x, _positions(), _posenc("rope", causal=True))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want, atol=0.05 * float(jnp.abs(want).max()))


@pytest.mark.slow
def test_chunked_gradient_memory_is_far_below_one_score_matrix():
  length, block = 2048, 128
  q, k, v = _qkv(length=length)
  pos = jnp.broadcast_to(jnp.arange(length), (B, length))

  def loss(q, k, v):
    return attention.chunked_attention(
      q, k, v, pos, pos, AttentionCall(causal=True, block=block)
    ).sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
  scores_bytes = B * H * length * length * 4
  assert compiled.memory_analysis().temp_size_in_bytes < scores_bytes / 8


@pytest.mark.parametrize("with_bias", [False, True])  # without: the scale enters exp
def test_hand_written_softmax_backward_matches_autodiff_with_bias_and_masked_rows(with_bias):
  # [B, G, R, L, K] operands; row 0 of batch 1 has every key masked.
  q, k, v = _normal((B, G, 2, 6, K), 20), _normal((B, G, 7, K), 21), _normal((B, G, 7, K), 22)
  bias = _normal((B, G, 2, 6, 7), 23) if with_bias else None
  mask = jnp.asarray(np.random.default_rng(24).random((B, 6, 7)) < 0.7).at[1, 0].set(False)
  w = _normal((B, G, 2, 6, K), 25)

  def reference(q, k, v, bias):
    p = jax.nn.softmax(blocks.logits(q, k, mask, bias), axis=-1)
    o = jnp.einsum("bgrls,bgsk->bgrlk", p, v)
    return jnp.where(mask.any(-1)[:, None, None, :, None], o, 0.0)  # a row with no key: zeros

  def loss(fn):
    return lambda *args: jnp.sum(jnp.sin(fn(*args)) * w)

  def attend(q, k, v, mask, bias):  # one span over every row and key
    return blocks.attend_spans(q, k, v, (mask,), (bias,), None, ((0, 6, 7),))

  args = (q, k, v, bias)
  got_out = attend(q, k, v, mask, bias)
  np.testing.assert_allclose(got_out, reference(*args), atol=1e-6)
  argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
  got = jax.grad(loss(lambda *a: attend(*a[:3], mask, a[3])), argnums=argnums)
  want = jax.grad(loss(reference), argnums=argnums)
  for g, w_ in zip(got(*args), want(*args), strict=True):
    np.testing.assert_allclose(g, w_, atol=1e-5)


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])  # RoPE's path (no bias) scales in exp
@pytest.mark.parametrize("length", [37, 40])  # 40: 5 equal blocks, run as pairs of blocks
def test_causal_blocks_without_segments_mask_only_their_diagonal_and_give_unsplit_gradients(
  length, with_bias, with_sink, monkeypatch
):
  # No segments, no window: each block's mask covers the keys from its first query on (with
  # equal blocks, only the diagonal pairs are masked); the gradients of q, k, v, a learned bias
  # and the sink logits equal the one-block kernel's.
  q, k, v = _qkv(length=length)
  pos = _positions(length)
  w = _normal((H,), 30)
  sink = _normal((H,), 31) if with_sink else jnp.zeros(H)  # no sink: its gradient is zero
  key_bias = _normal((B, length, H), 33) if with_bias else None  # a bias per key, sliced by block
  out_w = _normal((B, length, H, K), 32)

  def grads():
    def loss(q, k, v, w, sink):
      def bias_fn(qpos, kpos):
        return w[None, :, None, None] * _position_bias(qpos, kpos)

      o = attention.dense_attention(
        q,
        k,
        v,
        pos,
        pos,
        AttentionCall(
          causal=True,
          bias_fn=bias_fn if with_bias else None,
          sink_H=sink if with_sink else None,
          key_bias_BSH=key_bias,
        ),
      )
      return jnp.sum(jnp.sin(o) * out_w)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, w, sink)

  want_loss, want = grads()  # one block
  monkeypatch.setattr(dense, "CAUSAL_QUERY_BLOCK", 8)  # 5 blocks
  pair_calls = []
  monkeypatch.setattr(
    dense, "attend_pairs", lambda *a: pair_calls.append(1) or block_pairs.attend_pairs(*a)
  )
  got_loss, got = grads()
  assert bool(pair_calls) == (length % 5 == 0)
  np.testing.assert_allclose(got_loss, want_loss, atol=1e-5)  # a sum of B L H K terms
  for g, w_ in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w_, atol=1e-5)

  # Negative control: with the blocks' masks dropped, the later keys count and the loss moves.
  def allow_all(qpos_BT, kpos_BE, *args, **kwargs):
    return jnp.ones(qpos_BT.shape + kpos_BE.shape[1:], bool)

  monkeypatch.setattr(dense, "attention_mask", allow_all)
  assert abs(grads()[0] - want_loss) > 1e-2


def test_masked_rewrites_only_the_last_keys():
  s = _normal((B, G, 2, 4, 7), 33)
  mask = jnp.asarray(np.random.default_rng(34).random((B, 4, 3)) < 0.5)
  got = blocks.masked(s, mask)
  full = jnp.concatenate([jnp.ones((B, 4, 4), bool), mask], axis=-1)
  np.testing.assert_array_equal(got, jnp.where(full[:, None, None], s, NEG))


def test_a_kernel_returning_another_shape_than_the_contracts_is_named():
  heads_first = attention.Kernel(
    "heads_first", None, lambda features: None,
    lambda q_BLHK, k, v, qpos, kpos, call: q_BLHK.transpose(0, 2, 1, 3),
  )  # fmt: skip
  q, k, v = _qkv(num_kv_heads=H)
  pos = _positions()
  with pytest.raises(ValueError, match=r"kernel 'heads_first' returned \(2, 4, 37, 8\), not \["):
    heads_first(q, k, v, pos, pos, AttentionCall(causal=True))
  np.testing.assert_array_equal(  # a kernel of the right shape passes through untouched
    attention.KERNELS["dense"](q, k, v, pos, pos, AttentionCall(causal=True)),
    attention.dense_attention(q, k, v, pos, pos, AttentionCall(causal=True)),
  )
