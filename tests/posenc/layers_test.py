"""Tests of per-layer encodings (posenc.layer_pattern, posenc.max_wavelength_pattern)."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer import config as config_lib
from roformer import posenc, testing
from roformer.nn.attention.kv_cache import KVCache

PATTERN = dict(layer_pattern="rope,nope,rope", max_wavelength_pattern="100,1000000")


def _model(posenc_fields, **fields):
  posenc_fields = dict(posenc_fields)
  kind = posenc_fields.pop("kind", "rope")
  return testing.random_model(testing.tiny_model_config(kind, posenc_fields, num_layers=5,
                                                        **fields))  # fmt: skip


def _block_output(model, i, positions_BL, layer_posenc=None):
  """Layer i's output on a fixed input at `positions_BL`, with its encoding or `layer_posenc`."""
  x_BLD = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, 16)), jnp.float32)
  pe = model.posenc.layer(i) if layer_posenc is None else layer_posenc
  state = model.posenc.layer_state(model.posenc.prepare(positions_BL), i)
  if layer_posenc is not None:
    state = layer_posenc.prepare(positions_BL)
  return np.asarray(model.layers[i](x_BLD, positions_BL, pe, rotary_state=state)[0])


def test_each_layer_uses_the_kind_and_base_the_patterns_name():
  model = _model(PATTERN)
  # Layer i: kind "rope,nope,rope"[i % 3], base "100,1000000"[i % 2].
  want = [("rope", 100.0), ("nope", None), ("rope", 100.0), ("rope", 1e6), ("nope", None)]
  for i, (kind, base) in enumerate(want):
    assert type(model.posenc.layer(i)) is posenc.POSENCS[kind]
    if base is not None:
      assert model.posenc.layer(i).cfg.max_wavelength == base
  # Behaviour: spreading the positions apart changes exactly the rotary layers' outputs ...
  pos = testing.arange_positions(2, 7)
  for i, (kind, base) in enumerate(want):
    changed = not np.allclose(_block_output(model, i, pos), _block_output(model, i, 3 * pos))
    assert changed == (kind == "rope"), i
    # ... and each rotary layer equals itself run with a plain RoPE of its base, not another's.
    if kind == "rope":
      for other in (100.0, 1e6):
        plain = testing.build_posenc("rope", num_heads=4, head_dim=4, max_wavelength=other)
        same = np.allclose(_block_output(model, i, 3 * pos),
                           _block_output(model, i, 3 * pos, plain), atol=1e-6)  # fmt: skip
        assert same == (other == base), (i, other)


def test_a_pattern_of_one_kind_equals_the_model_without_a_pattern():
  tokens, pos = testing.random_tokens(2, 9), testing.arange_positions(2, 9)
  for fields, plain in (
    (dict(layer_pattern="rope", max_wavelength_pattern="500"), dict(max_wavelength=500.0)),
    (dict(kind="nope", layer_pattern="nope,nope"), dict(kind="nope")),
  ):
    got = testing.forward(_model(fields), tokens, pos)
    want = testing.forward(_model(plain), tokens, pos)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  mixed = testing.forward(_model(dict(layer_pattern="rope,nope")), tokens, pos)
  assert not np.allclose(mixed, testing.forward(_model({}), tokens, pos), atol=1e-3)


def test_per_layer_parameters_follow_the_pattern():
  # FIRE layers build their own MLP; T5 layers share the model's table; NoPE layers have none.
  model = _model(dict(kind="fire", layer_pattern="fire,t5,nope"))
  assert [type(layer.posenc).__name__ for layer in model.layers] == [
    "Fire", "NoneType", "NoneType", "Fire", "NoneType"
  ]  # fmt: skip
  assert type(model.posenc.layer(1)) is type(model.posenc.layer(4)) is posenc.T5Bias
  assert model.posenc.layer(1) is model.posenc.layer(4)


def test_every_pattern_runs_in_the_chunked_kernel_as_in_the_dense_one():
  tokens, pos = testing.random_tokens(2, 13), testing.arange_positions(2, 13)
  for fields in (PATTERN, dict(kind="alibi", layer_pattern="alibi,nope,rope")):
    dense = testing.forward(_model(fields, attention_impl="dense"), tokens, pos)
    chunked = testing.forward(_model(fields, attention_impl="chunked", attention_block=4), tokens,
                              pos)  # fmt: skip
    np.testing.assert_allclose(chunked, dense, rtol=1e-5, atol=1e-5)


def test_prepare_gives_one_rotary_state_per_distinct_layer_encoding():
  model = _model(PATTERN)
  assert all(isinstance(c, KVCache) for c in model.init_caches(2, 9))
  state = model.posenc.prepare(jnp.asarray([[0, 8]] * 2))
  assert len(state) == 3  # rope at 100, nope, rope at 1e6: one state per distinct layer config
  assert model.posenc.layer_state(state, 1) is None


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(layer_pattern="rope,rop"), "unknown kind"),
    (dict(layer_pattern="rope,learned"), "token embeddings once, before any layer"),
    (dict(kind="sinusoidal", max_wavelength_pattern="100,1000"), "token embeddings once"),
    (dict(layer_pattern="nope,alibi"), "posenc.kind='rope' is not in posenc.layer_pattern"),
    (dict(layer_pattern="rope", max_wavelength_pattern="1e4,x"), "max_wavelength_pattern"),
    (dict(kind="nope", layer_pattern="nope,alibi", max_wavelength_pattern="10,100"),
     "applies to rotary layers"),
    (dict(layer_pattern="rope,nope", query_scale="llama4", query_scale_kinds="alibi"),
     "query_scale_kinds"),
  ],
)  # fmt: skip
def test_bad_patterns_are_refused_in_one_line_naming_the_field(fields, message):
  fields = dict(fields)
  with pytest.raises(ValueError, match=message) as info:
    testing.tiny_model_config(fields.pop("kind", "rope"), fields)
  assert "\n" not in str(info.value)


def test_patterns_are_refused_with_stacked_layers_and_in_linear_attention_when_a_layer_biases():
  with pytest.raises(ValueError, match="model.scan_layers"):
    testing.tiny_model_config("rope", dict(layer_pattern="rope,nope"), scan_layers=True)
  with pytest.raises(ValueError, match="posenc.kind='alibi' adds a bias.*model.attention='linear'"):
    testing.tiny_model_config("rope", dict(layer_pattern="rope,alibi"), attention="linear")
  cfg = testing.tiny_model_config("rope", dict(layer_pattern="rope,nope"), attention="linear")
  assert [type(testing.random_model(cfg).posenc.layer(i)).__name__ for i in range(2)] == [
    "Rope", "NoPE"
  ]  # fmt: skip


@pytest.mark.parametrize(
  "config_file, window_kind, qk_norms, query_scales",
  [
    ("configs/irope.py", "chunked", ["l2", "l2", "l2", "none"], [None, None, None, "llama4"]),
    ("configs/rnope_swa.py", "sliding", ["none"] * 4, [None] * 4),
  ],
)
def test_presets_give_each_layer_the_encoding_window_and_norms_they_name(
  config_file, window_kind, qk_norms, query_scales
):
  config = testing.tiny_config({"model.num_layers": 4}, config_file=config_file)
  model_cfg = config_lib.run_config_from_dict(config).model
  model = testing.random_model(model_cfg)
  assert [type(model.posenc.layer(i)).__name__ for i in range(4)] == ["Rope"] * 3 + ["NoPE"]
  # The preset's window: a quarter of default.py's data.seq_len (512), when the file was read.
  assert [layer.attn.window for layer in model.layers] == [128] * 3 + [0]
  assert {layer.attn.window_kind for layer in model.layers} == {window_kind}
  assert [layer.attn.qk_norm for layer in model.layers] == qk_norms
  scales = [layer.attn.query_scale for layer in model.layers]
  assert [None if s is None else s.kind for s in scales] == query_scales
