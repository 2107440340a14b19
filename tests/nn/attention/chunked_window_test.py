"""Tests of chunked local attention (model.attention_window_kind="chunked", Llama 4)."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer import testing
from roformer.nn.attention import banded, kernels, primitives
from roformer.nn.attention.call import AttentionCall

B, L, H, G, W = 2, 45, 4, 2, 6  # L is not a multiple of the block or of the chunk


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_chunked_mask_keeps_exactly_the_earlier_keys_of_the_query_chunk():
  pos = jnp.arange(13)[None, :]
  mask = np.asarray(primitives.attention_mask(pos, pos, causal=True, window=4,
                                              window_kind="chunked"))[0]  # fmt: skip
  for q in range(13):
    # By hand: chunks [0, 4), [4, 8), [8, 12), [12, 16).
    want = [k for k in range(13) if k <= q and k >= 4 * (q // 4)]
    assert list(np.flatnonzero(mask[q])) == want, q
  sliding = np.asarray(primitives.attention_mask(pos, pos, causal=True, window=4))[0]
  assert (sliding != mask).any()  # a query late in its chunk sees fewer keys than a window


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_and_banded_kernels_match_dense_under_chunked_windows(causal):
  assert banded.visited_blocks(L, 8, W, causal) < -(-L // 8)  # the banded path is taken
  q, k, v = _normal((B, L, H, 8), 0), _normal((B, L, G, 8), 1), _normal((B, L, G, 8), 2)
  pos = jnp.arange(L)[None, :] + jnp.array([[0], [50]])
  seg = (jnp.arange(L)[None, :] >= jnp.array([[27], [5]])).astype(jnp.int32)
  kw = dict(qseg_BL=seg, kseg_BS=seg, causal=causal, window=W, window_kind="chunked", block=8)
  dense = kernels.dense_attention(q, k, v, pos, pos, AttentionCall(**kw))
  np.testing.assert_allclose(
    kernels.chunked_attention(q, k, v, pos, pos, AttentionCall(**kw)), dense, atol=1e-5, rtol=1e-5
  )
  sliding = kernels.dense_attention(
    q, k, v, pos, pos, AttentionCall(**{**kw, "window_kind": "sliding"})
  )
  assert not np.allclose(sliding, dense, atol=1e-3)


def test_chunked_windows_generate_from_a_ring_buffer():
  testing.check_cached_generation(
    testing.tiny_model_config(attention_window=4, attention_window_kind="chunked")
  )
