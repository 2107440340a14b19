"""Tests of sliding windows: the banded kernel, global tokens and per-layer window patterns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer import testing
from roformer.nn.attention import banded as attention_window
from roformer.nn.attention import kernels as attention
from roformer.nn.attention import primitives
from roformer.nn.attention.call import AttentionCall
from roformer.nn.config import validate_model

B, L, H, G = 2, 29, 4, 2  # L is not a multiple of the block


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _pos(length=L):
  return jnp.arange(length)[None, :] + jnp.array([[0], [50]])


@jax.jit
def _weights(pos, seg):
  """Attention weights [variant, B, L, H, S] of dense, chunked and the banded kernel.

  Values are one-hot in the key index (K = S), so each output row is the weight of every key.
  """
  q, k = _normal((B, L, H, L), 0), _normal((B, L, G, L), 1)
  v = jnp.broadcast_to(jnp.eye(L)[None, :, None, :], (B, L, G, L))
  out = {}
  for causal in (True, False):
    for window in (1, 5, 12):
      kw = dict(qseg_BL=seg, kseg_BS=seg, causal=causal, window=window, block=8)
      out[causal, window, "dense"] = attention.dense_attention(
        q, k, v, pos, pos, AttentionCall(**kw)
      )
      out[causal, window, "chunked"] = attention.chunked_attention(
        q, k, v, pos, pos, AttentionCall(**kw)
      )
  return out


def test_windowed_chunked_kernel_visits_few_blocks_and_matches_dense():
  assert attention_window.visited_blocks(L, 8, 5, causal=True) == 3 < 4  # banded path taken
  seg = (jnp.arange(L)[None, :] >= jnp.array([[17], [5]])).astype(jnp.int32)
  w = _weights(_pos(), seg)
  for causal in (True, False):
    for window in (1, 5, 12):
      np.testing.assert_allclose(
        w[causal, window, "chunked"], w[causal, window, "dense"], atol=1e-5, rtol=1e-5
      )


def test_keys_farther_than_the_window_get_exactly_zero_weight():
  pos = _pos()
  w = _weights(pos, jnp.zeros((B, L), jnp.int32))
  pos_BL = np.asarray(pos)
  delta_BLS = pos_BL[:, :, None] - pos_BL[:, None, :]  # query - key
  for (causal, window, _), p_BLHS in w.items():
    p_BHLS = np.moveaxis(np.asarray(p_BLHS), 2, 1)
    far_BHLS = np.broadcast_to((np.abs(delta_BLS) >= window)[:, None], p_BHLS.shape)
    allowed_BLS = (np.abs(delta_BLS) < window) & ((delta_BLS >= 0) if causal else True)
    allowed_BHLS = np.broadcast_to(allowed_BLS[:, None], p_BHLS.shape)
    assert np.all(p_BHLS[far_BHLS] == 0.0)  # exactly, not approximately
    assert np.all(p_BHLS[allowed_BHLS] > 0.0)
    np.testing.assert_allclose(p_BHLS.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_window_at_least_the_length_equals_full_attention(impl):
  q, k, v = _normal((B, L, H, 8), 3), _normal((B, L, G, 8), 4), _normal((B, L, G, 8), 5)
  pos = _pos()
  kernel = attention.KERNELS[impl]
  for causal in (True, False):
    full = kernel(q, k, v, pos, pos, AttentionCall(causal=causal, block=8))
    for window in (L, L + 7):
      got = kernel(q, k, v, pos, pos, AttentionCall(causal=causal, window=window, block=8))
      np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)


def test_global_tokens_attend_and_are_attended_by_all():
  pos = jnp.arange(12)[None]
  mask = np.asarray(primitives.attention_mask(pos, pos, causal=False, window=2, global_tokens=2))[0]
  assert mask[:2].all() and mask[:, :2].all()  # global rows and columns
  assert not mask[5, 8] and mask[5, 6] and not mask[5, 3]  # others keep the window
  q, k, v = _normal((1, 12, H, 8), 6), _normal((1, 12, G, 8), 7), _normal((1, 12, G, 8), 8)
  kw = dict(causal=False, window=2, global_tokens=2, block=4)
  np.testing.assert_allclose(
    attention.chunked_attention(q, k, v, pos, pos, AttentionCall(**kw)),
    attention.dense_attention(q, k, v, pos, pos, AttentionCall(**kw)),
    atol=1e-5,
  )


def test_encoder_with_global_tokens_and_window_pattern_runs_the_mask_per_layer():
  cfg = testing.tiny_model_config(
    kind="encoder", num_kv_heads=0, attention_window_pattern="3,0", global_tokens=1
  )
  model = testing.random_model(cfg)
  assert [layer.attn.window for layer in model.layers] == [3, 0]
  assert model.layers[0].attn.global_tokens == 1
  toks = testing.random_tokens(1, 12)
  out = testing.forward(model, toks, testing.arange_positions(1, 12))
  # Token 11 reaches token 0 (global) but, in the windowed layer, not token 5; the global layer
  # then spreads token 5 everywhere, so compare a one-layer model.
  one = testing.random_model(dataclasses.replace(cfg, num_layers=1))
  base = testing.forward(one, toks, testing.arange_positions(1, 12))[0, 11]
  far = testing.forward(
    one, toks.at[0, 5].set((toks[0, 5] + 1) % testing.TINY_VOCAB), testing.arange_positions(1, 12)
  )[0, 11]
  first = testing.forward(
    one, toks.at[0, 0].set((toks[0, 0] + 1) % testing.TINY_VOCAB), testing.arange_positions(1, 12)
  )[0, 11]
  np.testing.assert_array_equal(base, far)
  assert np.abs(base - first).max() > 1e-4
  assert out.shape == (1, 12, testing.TINY_VOCAB)


def test_window_pattern_repeats_over_layers_and_bad_values_are_named():
  cfg = dataclasses.replace(
    testing.tiny_model_config(), num_layers=5, attention_window_pattern="8,8,0"
  )
  assert [spec.window for spec in cfg.layers] == [8, 8, 0, 8, 8]
  plain = dataclasses.replace(cfg, attention_window_pattern="", attention_window=4)
  assert [spec.window for spec in plain.layers] == [4] * 5
  for fields, message in [
    (dict(attention_window_pattern="8,x"), "model.attention_window_pattern"),
    (dict(global_tokens=2, attention_window=4), "model.global_tokens"),  # a decoder
    (dict(kind="encoder", global_tokens=2), "needs a sliding window"),
  ]:
    with pytest.raises(ValueError, match=message):
      validate_model(dataclasses.replace(testing.tiny_model_config(), **fields))
