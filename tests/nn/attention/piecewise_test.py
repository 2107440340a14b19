"""Piecewise positions in the attention kernels (context extensions): dense against a naive
numpy reference that rotates each query by its pair's effective distance, chunked against dense,
and the model-level path (unrotated q, k handed to the kernel) against the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention import kernels
from roformer.nn.attention.call import AttentionCall
from roformer.posenc import make_posenc
from roformer.posenc.config import ContextExtension, PosEncConfig, RopeScaling
from roformer.posenc.extension import position_pieces

B, L, H, G, K = 2, 29, 4, 2, 8  # L is not a multiple of BLOCK; GQA
BLOCK = 8
BASE = 10000.0

EXTENSIONS = [
  ContextExtension("self_extend_floor", window=4, group=3),
  ContextExtension("self_extend", window=5, group=3),  # fractional query positions
  ContextExtension("dca_paper", chunk=6, local=2),
  ContextExtension("rerope_clamp", window=5),
  ContextExtension("string", shift=9, local=3),
  ContextExtension("sinks", sinks=2, window=6),
]


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _positions():
  # Row 1 starts at 3: pieces are computed from the given positions, not from indices.
  return jnp.arange(L)[None, :] + jnp.array([[0], [3]])


def _posenc(ext, scaling=None):
  cfg = PosEncConfig(kind="rope", extension=ext, scaling=scaling or RopeScaling())
  with nnx.use_eager_sharding(False):
    return make_posenc(cfg, num_heads=H, head_dim=K, emb_dim=H * K, causal=True, rngs=nnx.Rngs(0))


def _rotate_np(x_K, d):
  """x rotated by relative position d (interleaved pairs, base BASE), float64."""
  inv_freq = BASE ** (-np.arange(0, K, 2) / K)
  c, s = np.cos(d * inv_freq), np.sin(d * inv_freq)
  out = np.empty(K)
  out[0::2] = x_K[0::2] * c - x_K[1::2] * s
  out[1::2] = x_K[1::2] * c + x_K[0::2] * s
  return out


def _reference(ext, q, k, v, pos):
  """Naive attention: logit(i, j) = rot(q_i, d_ij) . k_j / sqrt(K) with d_ij = qrot - krot of
  the piece covering (i, j); causal; uncovered pairs masked."""
  q, k, v, pos = (np.asarray(x, np.float64) for x in (q, k, v, pos))
  pieces = position_pieces(ext, jnp.asarray(pos, jnp.int32), jnp.asarray(pos, jnp.int32))
  out = np.zeros((B, L, H, K))
  for b in range(B):
    dist = np.full((L, L), np.nan)
    for qrot, krot, where in pieces:
      d = np.asarray(qrot[b])[:, None] - np.asarray(krot[b])[None, :]
      dist = np.where(np.asarray(where[b]), d, dist)
    for h in range(H):
      g = h // (H // G)
      for i in range(L):
        keys = [j for j in range(i + 1) if not np.isnan(dist[i, j])]
        logits = np.array([_rotate_np(q[b, i, h], dist[i, j]) @ k[b, j, g] for j in keys])
        p = np.exp(logits - logits.max())
        p = p / p.sum()
        out[b, i, h] = p @ v[b, keys, g]
  return out


def _run(kernel, ext, q, k, v, pos):
  posenc = _posenc(ext)
  state = posenc.prepare(pos)
  return kernel(
    q,
    k,
    v,
    pos,
    pos,
    AttentionCall(
      causal=True,
      block=BLOCK,
      pieces_fn=posenc.position_pieces,
      rotate_fn=lambda q, k, qp, kp: posenc.rotate(q, k, qp, kp, state),
    ),
  )


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.kind)
def test_piecewise_dense_equals_naive_reference(ext):
  q, k, v = _normal((B, L, H, K), 0), _normal((B, L, G, K), 1), _normal((B, L, G, K), 2)
  got = _run(kernels.dense_attention, ext, q, k, v, _positions())
  # The kernel scales logits by 1/sqrt(K): the reference gets queries scaled alike.
  want = _reference(ext, q / np.sqrt(K), k, v, _positions())
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.kind)
def test_piecewise_chunked_equals_dense(ext):
  q, k, v = _normal((B, L, H, K), 3), _normal((B, L, G, K), 4), _normal((B, L, G, K), 5)
  dense = _run(kernels.dense_attention, ext, q, k, v, _positions())
  chunked = jax.jit(lambda q, k, v: _run(kernels.chunked_attention, ext, q, k, v, _positions()))
  np.testing.assert_allclose(np.asarray(chunked(q, k, v)), np.asarray(dense), atol=1e-5, rtol=0)


def test_piecewise_dense_causal_query_blocks_equal_one_span():
  # L = 300 splits causal self-attention into query blocks; each block gets its own pieces.
  n = 300
  ext = ContextExtension("self_extend", window=16, group=4)
  q, k, v = _normal((1, n, H, K), 6), _normal((1, n, G, K), 7), _normal((1, n, G, K), 8)
  pos = jnp.arange(n)[None, :]
  assert len(kernels.dense.causal_query_blocks(n)) > 1
  dense = _run(kernels.dense_attention, ext, q, k, v, pos)
  chunked = _run(kernels.chunked_attention, ext, q, k, v, pos)
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(dense), atol=1e-5, rtol=0)


def test_self_extend_with_window_beyond_the_length_is_plain_rope():
  # Every distance is below W: the neighbour piece covers all pairs, as plain RoPE would.
  q, k, v = _normal((B, L, H, K), 9), _normal((B, L, G, K), 10), _normal((B, L, G, K), 11)
  pos = _positions()
  posenc = _posenc(ContextExtension("self_extend", window=L, group=4))
  qr, kr = posenc.rotate(q, k, pos, pos)
  plain = kernels.dense_attention(qr, kr, v, pos, pos, AttentionCall(causal=True))
  extended = _run(
    kernels.dense_attention, ContextExtension("self_extend", window=L, group=4), q, k, v, pos
  )
  np.testing.assert_allclose(np.asarray(extended), np.asarray(plain), atol=1e-6, rtol=0)
  # Negative control: a window below the largest distance groups the farthest keys. (At
  # W = L - 1 the single grouped pair, (28, 0), lands at floor(28/4) + 28 - 7 = 28, its own
  # distance: the regimes meet.)
  shorter = _run(
    kernels.dense_attention, ContextExtension("self_extend", window=L - 5, group=4), q, k, v, pos
  )
  assert np.abs(np.asarray(shorter) - np.asarray(plain)).max() > 1e-4


def test_piecewise_uses_the_pass_rotary_state():
  # YaRN's frequencies and attention factor apply to every piece (the state handed in).
  ext = ContextExtension("rerope", window=5)
  q, k, v = _normal((B, L, H, K), 12), _normal((B, L, G, K), 13), _normal((B, L, G, K), 14)
  pos = _positions()
  yarn = RopeScaling(kind="yarn", factor=4.0, original_max_len=8)
  plain, scaled = _posenc(ext), _posenc(ext, yarn)
  outs = []
  for posenc in (plain, scaled):
    state = posenc.prepare(pos)
    outs.append(
      kernels.dense_attention(
        q,
        k,
        v,
        pos,
        pos,
        AttentionCall(
          causal=True,
          pieces_fn=posenc.position_pieces,
          rotate_fn=lambda q, k, qp, kp, p=posenc, s=state: p.rotate(q, k, qp, kp, s),
        ),
      )  # fmt: skip
    )
  assert np.abs(np.asarray(outs[0]) - np.asarray(outs[1])).max() > 1e-4


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_attention_layer_with_extension_equals_kernel_on_unrotated_qk(impl):
  ext = ContextExtension("dca", chunk=6, local=2)
  posenc = _posenc(ext)
  with nnx.use_eager_sharding(False):
    layer = testing.attention_layer(
      emb_dim=H * K, num_heads=H, head_dim=K, num_kv_heads=G, attention_impl=impl,
      attention_block=BLOCK, seed=1,
    )  # fmt: skip
  x = _normal((B, L, H * K), 15)
  pos = _positions()
  got, _ = layer(x, pos, posenc)
  q, k, v = layer.qkv(x)
  want = _run(kernels.dense_attention, ext, q, k, v, pos)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def _layer_with(ext, seed):
  posenc_cfg = PosEncConfig(kind="rope", extension=ext)
  with nnx.use_eager_sharding(False):
    return testing.attention_layer(
      emb_dim=H * K, num_heads=H, head_dim=K, num_kv_heads=G, posenc=posenc_cfg, seed=seed
    )


def test_rerope_is_the_released_patch_with_its_log_n_queries():
  # bojone/rerope's rerope_patch.py multiplies queries by max(1, log(pos + 1) / log(L0)), L0 its
  # training_length, before the rectified attention.
  ext, L0 = ContextExtension("rerope", window=5, train_len=8), 8
  layer = _layer_with(ext, seed=2)
  x, pos = _normal((B, L, H * K), 16), _positions()
  got, _ = layer(x, pos, _posenc(ext))
  q, k, v = layer.qkv(x)
  logn_BL = np.maximum(1.0, np.log(np.asarray(pos) + 1.0) / np.log(L0))
  want = _reference(ext, np.asarray(q) * logn_BL[:, :, None, None] / np.sqrt(K), k, v, pos)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  # Negative control: the clamp alone, without the patch's scaling.
  clamp = ContextExtension("rerope_clamp", window=5)
  unscaled, _ = _layer_with(clamp, seed=2)(x, pos, _posenc(clamp))
  np.testing.assert_allclose(
    np.asarray(unscaled), _reference(ext, np.asarray(q) / np.sqrt(K), k, v, pos), atol=1e-5
  )
  assert np.abs(np.asarray(unscaled) - want).max() > 1e-3


def test_dca_scales_every_logit_by_chunkllama_mscale_squared():
  # ChunkLlama's cos and sin times 0.05 ln(n / L0) + 1 for queries and keys: each row's logits
  # times its square, n the row's length (29 and 32 keys here: positions 0..28 and 3..31).
  ext, L0 = ContextExtension("dca", chunk=6, local=2, train_len=8), 8
  layer = _layer_with(ext, seed=3)
  x, pos = _normal((B, L, H * K), 17), _positions()
  got, _ = layer(x, pos, _posenc(ext))
  q, k, v = layer.qkv(x)
  n_B = np.asarray(pos).max(axis=1) + 1.0
  m2_B = (0.05 * np.log(n_B / L0) + 1.0) ** 2
  want = _reference(ext, np.asarray(q) * m2_B[:, None, None, None] / np.sqrt(K), k, v, pos)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  # Negative control: the paper's DCA, the same pieces without the factor.
  paper = ContextExtension("dca_paper", chunk=6, local=2)
  plain, _ = _layer_with(paper, seed=3)(x, pos, _posenc(paper))
  assert np.abs(np.asarray(plain) - want).max() > 1e-3
