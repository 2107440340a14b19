"""Tests of roformer/generate.py: cached decoding equals repeated full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer import generate as gen
from roformer import testing
from roformer.nn.attention import kv_cache
from roformer.posenc import POSENCS
from roformer.posenc.config import RopeScaling

P, N = testing.PROMPT_LEN, testing.NEW_TOKENS


def _scaling(kind):
  return {"scaling": RopeScaling(kind=kind, factor=2.0, original_max_len=4)}


# Every registered encoding the decoding cache can run, then the settings that change the rotary
# state. A content-dependent bias (CoPE's) needs all keys at once, so generation refuses it
# (`test_generation_refuses_a_content_dependent_encoding`).
ENCODINGS = [
  *[(kind, None) for kind, cls in POSENCS.items() if cls.content_bias is None],
  ("rope", _scaling("dynamic")),
  ("rope", {"rope_resonance": True}),
  pytest.param("rope", {**_scaling("yarn"), "rope_resonance": True}, marks=pytest.mark.slow),
  *[
    pytest.param("rope", _scaling(k), marks=pytest.mark.slow)
    for k in ("linear", "ntk", "ntk_by_parts", "yarn", "llama3")
  ],
  pytest.param("xpos", _scaling("dynamic"), marks=pytest.mark.slow),
]


def test_prefix_forward_equals_padded_forward_except_for_dynamic_ntk():
  # The reference above pads; for an encoding whose state ignores the length, padding is
  # invisible, so the padded reference is the plain repeated forward over the prefix.
  toks = testing.random_tokens(1, P + N)
  for fields, same in ((None, True), (_scaling("dynamic"), False)):
    model = testing.random_model(testing.tiny_model_config("rope", fields))
    prefix = testing.forward(model, toks[:, :P], testing.arange_positions(1, P))[:, -1]
    padded = testing.forward(model, toks, testing.arange_positions(1, P + N))[:, P - 1]
    assert np.allclose(prefix, padded, atol=1e-5) == same


@pytest.mark.parametrize("posenc, fields", ENCODINGS)
def test_cached_generation_equals_full_forward_for_every_encoding(posenc, fields):
  testing.check_cached_generation(testing.tiny_model_config(posenc, fields))


@pytest.mark.parametrize(
  "fields",
  [
    dict(num_kv_heads=1),  # MQA
    dict(num_kv_heads=4, attention_impl="chunked", attention_block=2),
    dict(attention_window=3),  # ring buffer of 3 slots, shorter than the sequence
    dict(attention_window_pattern="2,0"),  # local/global alternation
  ],
)
def test_cached_generation_equals_full_forward_for_softmax_variants(fields):
  testing.check_cached_generation(testing.tiny_model_config("t5", **fields))


@pytest.mark.parametrize(
  "posenc, posenc_fields, fields",
  [
    ("rope", dict(layer_pattern="rope,nope", max_wavelength_pattern="100,10000,1000000"), {}),
    ("alibi", dict(layer_pattern="alibi,rope,nope"), dict(attention_window_pattern="3,0")),
    ("rope", dict(layer_pattern="rope,rope,nope", query_scale="llama4", query_scale_floor=2.0,
                  query_scale_kinds="nope"),
     dict(num_layers=3, attention_window_pattern="4,4,0", attention_window_kind="chunked",
          qk_norm="l2", qk_norm_kinds="rope")),  # iRoPE
    ("rope", dict(query_scale="logn", query_scale_len=4), dict(qk_norm="rmsnorm")),
    ("rope", {}, dict(qk_norm="rmsnorm_whole", num_kv_heads=1)),  # OLMo 2's, over GQA keys
    ("rope", dict(query_scale="ssmax"), dict(attention_impl="chunked", attention_block=2)),
    ("rope", {}, dict(attention_sinks=True)),
    ("alibi", {}, dict(attention_sinks=True, attention_window_pattern="3,0",
                       attention_impl="chunked", attention_block=2)),  # ring buffer, banded
    ("nope", {}, dict(forget_gate=True)),  # FoX: c continued from the cache
    ("rope", {}, dict(forget_gate=True, attention_window_pattern="3,0",
                      attention_impl="chunked", attention_block=2)),
    ("pope", dict(layer_pattern="pope,nope"), dict(attention_window_pattern="3,0",
                                                    attention_impl="chunked", attention_block=2)),
    ("pope", {}, dict(attention_sinks=True, qk_norm="l2")),  # 2K-wide keys, l2 over them
  ],
)  # fmt: skip
def test_cached_generation_equals_full_forward_for_per_layer_encodings_qk_norm_and_temperature(
  posenc, posenc_fields, fields
):
  testing.check_cached_generation(testing.tiny_model_config(posenc, posenc_fields, **fields))


def test_kv_cache_holds_kv_heads_and_window_slots():
  model = testing.random_model(
    testing.tiny_model_config(num_kv_heads=1, attention_window_pattern="3,0")
  )
  local, full = model.init_caches(2, 10)
  assert local.k_BCGK.shape == (2, 3, 1, 4)  # the ring buffer of the window
  assert full.k_BCGK.shape == (2, 10, 1, 4)


def test_slot_positions_of_a_ring_buffer():
  pos, valid = kv_cache.slot_positions(jnp.int32(7), 3)  # positions 0..6 written
  np.testing.assert_array_equal(pos, [6, 4, 5])
  np.testing.assert_array_equal(valid, [True, True, True])
  pos, valid = kv_cache.slot_positions(jnp.int32(2), 4)
  np.testing.assert_array_equal(valid, [True, True, False, False])


def test_sampling_filters_keep_only_allowed_tokens():
  logits_BV = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 64))
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  draws = np.concatenate([gen.sample_next(logits_BV, k, temperature=1.0, top_k=2) for k in keys])
  assert set(draws.tolist()) == {0, 1}
  draws = np.concatenate([gen.sample_next(logits_BV, k, temperature=1.0, top_p=0.9) for k in keys])
  assert set(draws.tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.9 <= 0.5 + 0.3 + 0.15
  np.testing.assert_array_equal(gen.sample_next(logits_BV, None), np.zeros(64))


def test_encoders_and_bad_arguments_are_refused_with_the_reason():
  encoder = testing.random_model(testing.tiny_model_config(kind="encoder", num_kv_heads=0))
  with pytest.raises(ValueError, match="causal decoder"):
    gen.generate(encoder, testing.random_tokens(1, 2), max_new_tokens=1)
  decoder = testing.random_model(testing.tiny_model_config())
  with pytest.raises(ValueError, match="top_p"):
    gen.generate(decoder, testing.random_tokens(1, 2), max_new_tokens=1, top_p=0.0)
  with pytest.raises(ValueError, match="max_len"):
    gen.generate(
      testing.random_model(testing.tiny_model_config("learned")),
      testing.random_tokens(1, 60),
      max_new_tokens=10,
    )


def test_a_generation_larger_than_memory_is_refused_before_compiling():
  decoder = testing.random_model(testing.tiny_model_config())
  with pytest.raises(ValueError, match=r"needs [\d,.]+ GiB of decoding cache, more than half"):
    gen.generate(decoder, testing.random_tokens(1, 2), max_new_tokens=1_000_000_000)


def test_generation_refuses_a_content_dependent_encoding():
  model = testing.random_model(testing.tiny_model_config("cope", {"cope_npos_max": 64}))
  with pytest.raises(ValueError, match="posenc.kind='cope'.*decoding cache"):
    gen.generate(model, testing.random_tokens(1, 4), max_new_tokens=2)
