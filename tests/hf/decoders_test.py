"""Tests of roformer/hf/decoders.py against tiny HF causal LMs saved in tests/fixtures/
(tests/fixtures/make_hf_decoder_fixtures.py wrote them and their logits with transformers)."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from flax import nnx

from roformer import generate, hf, testing
from roformer.nn.model import Decoder, make_model
from roformer.posenc.config import RopeScaling

FAMILIES = ("llama", "mistral", "qwen2", "gpt_neox")
TOL = 1e-4


def _dir(family):
  return testing.FIXTURES / f"hf_{family}_tiny"


def _reference(family):
  return dict(np.load(_dir(family) / "reference.npz"))


def _hf_config(family):
  return json.loads((_dir(family) / "config.json").read_text())


@pytest.fixture(scope="module")
def models():
  return {family: hf.load_hf_decoder(_dir(family)) for family in FAMILIES}


def _logits(model, input_ids):
  return np.asarray(testing.forward(model, input_ids, testing.arange_positions(*input_ids.shape)))


def _max_error(model, family, key="logits"):
  ref = _reference(family)
  return float(np.abs(_logits(model, ref["input_ids"]) - ref[key]).max())


def _with(model, **fields):
  """The model's parameters under its config with `fields` replaced (the same parameter tree)."""
  cfg = dataclasses.replace(model.cfg, **fields)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))


def _copy_with_config(tmp_path, family, **changes):
  """A copy of the family's fixture directory whose config.json has `changes` applied."""
  shutil.copy(_dir(family) / "model.safetensors", tmp_path / "model.safetensors")
  config = {**_hf_config(family), **changes}
  (tmp_path / "config.json").write_text(json.dumps(config))
  return tmp_path


# ---- Parity with transformers ----


@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_decoder_logits_match_transformers(models, family):
  model = models[family]
  assert isinstance(model, Decoder)
  logits = _logits(model, _reference(family)["input_ids"])
  assert logits.dtype == np.float32
  np.testing.assert_allclose(logits, _reference(family)["logits"], rtol=0, atol=TOL)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_blockwise_kernel_on_an_imported_decoder_matches_transformers(family):
  # Query and key blocks of 4 over 16 positions; Mistral's window runs the banded kernel.
  model = hf.load_hf_decoder(_dir(family), attention_impl="chunked", attention_block=4)
  assert _max_error(model, family) < TOL


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_llama_weights_under_other_rope_scalings_match_transformers(tmp_path, kind):
  ref = _reference("llama")
  rope = json.loads(str(ref[f"rope_{kind}"]))
  path = _copy_with_config(
    tmp_path,
    "llama",
    rope_parameters=rope,
    max_position_embeddings=int(ref[f"max_position_embeddings_{kind}"]),
  )
  model = hf.load_hf_decoder(path)
  assert model.cfg.posenc.scaling.kind == kind
  assert _max_error(model, "llama", f"logits_{kind}") < TOL


def test_configs_map_every_field_that_changes_the_numbers(models):
  llama, mistral, qwen2, neox = (models[f].cfg for f in FAMILIES)
  assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.emb_dim) == (4, 2, 16, 32)
  assert (llama.norm, llama.norm_eps, llama.activation, llama.use_bias) == (
    "rmsnorm",
    1e-5,
    "swiglu",
    False,
  )
  assert not llama.tie_embeddings and llama.posenc.rope_layout == "half"
  s = llama.posenc.scaling
  assert (s.kind, s.factor, s.original_max_len, s.low_freq_factor, s.high_freq_factor) == (
    "llama3",
    8.0,
    256,
    1.0,
    4.0,
  )
  assert (mistral.attention_window, mistral.posenc.max_wavelength) == (5, 1000.0)
  assert (qwen2.use_bias, qwen2.qkv_bias, qwen2.tie_embeddings) == (False, True, True)
  assert (qwen2.posenc.scaling.kind, qwen2.posenc.scaling.original_max_len) == ("yarn", 32)
  assert (neox.norm, neox.activation, neox.use_bias, neox.parallel_residual) == (
    "layernorm",
    "gelu",
    True,
    True,
  )
  assert (neox.posenc.rope_fraction, neox.head_dim) == (0.5, 8)


def test_older_config_keys_give_the_same_model_config():
  # transformers 4 wrote rope_theta and rope_scaling ("type" in early versions), and GPT-NeoX
  # rotary_emb_base and rotary_pct, where transformers 5 writes rope_parameters.
  llama = _hf_config("llama")
  rope = llama.pop("rope_parameters")
  llama["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")
  llama["rope_scaling"] = rope
  assert hf.hf_decoder_config(llama) == hf.hf_decoder_config(_hf_config("llama"))
  neox = _hf_config("gpt_neox")
  rope = neox.pop("rope_parameters")
  neox.update(rotary_emb_base=rope["rope_theta"], rotary_pct=rope["partial_rotary_factor"])
  assert hf.hf_decoder_config(neox) == hf.hf_decoder_config(_hf_config("gpt_neox"))


def test_num_key_value_heads_absent_takes_hf_default_and_null_the_number_of_heads():
  llama, mistral = _hf_config("llama"), _hf_config("mistral")
  del llama["num_key_value_heads"], mistral["num_key_value_heads"]
  assert hf.hf_decoder_config(llama).num_kv_heads == 4  # LlamaConfig: the number of heads
  assert hf.hf_decoder_config({**mistral, "num_attention_heads": 8}).num_kv_heads == 8
  assert hf.hf_decoder_config({**mistral, "num_key_value_heads": None}).num_kv_heads == 4


def test_qwen2_sliding_layers_follow_max_window_layers():
  config = {**_hf_config("qwen2"), "use_sliding_window": True, "sliding_window": 5}
  config.update(max_window_layers=1, layer_types=None)
  cfg = hf.hf_decoder_config(config)
  assert (cfg.attention_window, cfg.attention_window_pattern) == (0, "0,5")
  config["layer_types"] = ["sliding_attention", "sliding_attention"]
  assert hf.hf_decoder_config(config).attention_window == 5
  # Without use_sliding_window, HF drops the window even on layers typed sliding.
  config["use_sliding_window"] = False
  assert hf.hf_decoder_config(config).attention_window == 0


# ---- What each mapped field does: the wrong choice gives other logits ----

NEGATIVE_CONTROLS = [
  ("llama", "interleaved RoPE layout", lambda c: dict(posenc=_rope(c, rope_layout="interleaved"))),
  ("llama", "no llama3 scaling", lambda c: dict(posenc=_rope(c, scaling=_no_scaling()))),
  ("qwen2", "no yarn scaling", lambda c: dict(posenc=_rope(c, scaling=_no_scaling()))),
  ("gpt_neox", "sequential residual", lambda c: dict(parallel_residual=False)),
  ("gpt_neox", "every dim rotated", lambda c: dict(posenc=_rope(c, rope_fraction=1.0))),
  (
    "gpt_neox",
    "interleaved RoPE layout",
    lambda c: dict(posenc=_rope(c, rope_layout="interleaved")),
  ),
  ("mistral", "no window", lambda c: dict(attention_window=0)),
  # HF keeps keys with q - k < sliding_window: one more or one fewer key is another model.
  ("mistral", "window one shorter", lambda c: dict(attention_window=c.attention_window - 1)),
  ("mistral", "window one longer", lambda c: dict(attention_window=c.attention_window + 1)),
  ("mistral", "epsilon 1e-2", lambda c: dict(norm_eps=1e-2)),
]


def _rope(cfg, **fields):
  return dataclasses.replace(cfg.posenc, **fields)


def _no_scaling():
  return RopeScaling()


@pytest.mark.parametrize(("family", "what", "fields"), NEGATIVE_CONTROLS)
def test_a_wrong_mapping_gives_logits_far_from_transformers(models, family, what, fields):
  del what  # the test id
  wrong = _with(models[family], **fields(models[family].cfg))
  assert _max_error(wrong, family) > 100 * TOL


# ---- Generation ----


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_repeated_full_forward_passes(models, family):
  # 3 + 6 positions pass Mistral's window of 5, so its decoding cache runs as a ring buffer.
  model = models[family]
  prompt_BP = np.asarray(_reference(family)["input_ids"][:, : testing.PROMPT_LEN])
  want_BT, _ = testing.greedy_by_full_forward(model, prompt_BP, testing.NEW_TOKENS)
  got_BT = generate.generate(model, prompt_BP, max_new_tokens=testing.NEW_TOKENS)
  np.testing.assert_array_equal(got_BT, want_BT)
  logits = generate.cached_logits(model, want_BT, testing.PROMPT_LEN)
  full = _logits(model, np.asarray(want_BT))[:, testing.PROMPT_LEN - 1 :]
  np.testing.assert_allclose(logits, full, rtol=0, atol=1e-5)


# ---- Refused fields: one line naming the field ----

REFUSED = [
  ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
  ("llama", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
  ("llama", dict(mlp_bias=True), "mlp_bias=True with attention_bias=False"),
  ("llama", dict(model_type="gpt2"), "model_type='gpt2'"),
  (
    "llama",
    dict(rope_parameters={"rope_type": "longrope", "long_factor": [1.0] * 4}),
    "rope_parameters.short_factor is required for rope_type='longrope'",
  ),
  (
    "llama",
    dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
    "partial_rotary_factor=0.5 is not supported for llama",
  ),
  (
    "llama",
    dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
    "rope_parameters differs per layer type",
  ),
  ("llama", dict(rope_parameters={"rope_type": "linear"}), "rope_parameters.factor is required"),
  ("qwen2", dict(layer_types=["full_attention", "chunked"]), "layer_types="),
  ("gpt_neox", dict(hidden_act="gelu_new"), "hidden_act='gelu_new'"),
  ("gpt_neox", dict(attention_bias=False), "attention_bias=False"),
]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
REFUSED += [
  ("qwen2", dict(rope_parameters={**YARN, "attention_factor": 1.5}), "attention_factor=1.5"),
  ("qwen2", dict(rope_parameters={**YARN, "truncate": False}), "truncate=False"),
  (
    "gpt_neox",
    dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.375}),
    "partial_rotary_factor=0.375 rotates 3 of 8 dims",
  ),
  ("mistral", dict(num_key_value_heads=3), "model.num_heads=4 is not divisible"),
]


@pytest.mark.parametrize(("family", "changes", "message"), REFUSED)
def test_an_unsupported_field_is_refused_in_one_line_naming_it(family, changes, message):
  with pytest.raises(hf.HFConversionError, match=message) as raised:
    hf.hf_decoder_config({**_hf_config(family), **changes})
  assert "\n" not in str(raised.value)


def test_parameter_overrides_are_refused_and_others_allowed():
  with pytest.raises(hf.HFConversionError, match="cannot override \\['num_layers'\\]"):
    hf.hf_decoder_config(_hf_config("llama"), num_layers=1)
  cfg = hf.hf_decoder_config(_hf_config("llama"), attention_impl="chunked", dtype="bfloat16")
  assert (cfg.attention_impl, cfg.dtype) == ("chunked", "bfloat16")


# ---- Tensors ----


def _tensors(family):
  return hf.load_hf_tensors(_dir(family))


def _write(tmp_path, family, tensors):
  from safetensors.numpy import save_file

  shutil.copy(_dir(family) / "config.json", tmp_path / "config.json")
  save_file(tensors, tmp_path / "model.safetensors")
  return tmp_path


def test_a_missing_tensor_is_named(tmp_path):
  tensors = _tensors("llama")
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  with pytest.raises(hf.HFConversionError, match="model.layers.1.self_attn.k_proj.weight"):
    hf.load_hf_decoder(_write(tmp_path, "llama", tensors))


def test_an_unused_tensor_is_named(tmp_path):
  tensors = {**_tensors("mistral"), "model.layers.0.self_attn.o_proj.bias": np.zeros(32, "f4")}
  with pytest.raises(hf.HFConversionError, match="have no place in the Decoder.*o_proj.bias"):
    hf.load_hf_decoder(_write(tmp_path, "mistral", tensors))


def test_a_stored_tied_output_layer_must_equal_the_embedding(tmp_path):
  tensors = _tensors("qwen2")
  embed = tensors["model.embed_tokens.weight"]
  model = hf.load_hf_decoder(_write(tmp_path, "qwen2", {**tensors, "lm_head.weight": embed}))
  assert _max_error(model, "qwen2") < TOL
  with pytest.raises(hf.HFConversionError, match="lm_head.weight differs from"):
    hf.load_hf_decoder(_write(tmp_path, "qwen2", {**tensors, "lm_head.weight": embed + 1}))


def test_gpt_neox_buffers_of_older_exports_are_skipped_as_transformers_does(tmp_path):
  tensors = {
    **_tensors("gpt_neox"),
    "gpt_neox.layers.0.attention.bias": np.ones((1, 1, 4, 4), bool),
    "gpt_neox.layers.0.attention.masked_bias": np.asarray(-1e9, "f4"),
    "gpt_neox.layers.0.attention.rotary_emb.inv_freq": np.ones(2, "f4"),
  }
  assert _max_error(hf.load_hf_decoder(_write(tmp_path, "gpt_neox", tensors)), "gpt_neox") < TOL


def test_a_fused_qkv_of_the_wrong_width_is_named(tmp_path):
  tensors = _tensors("gpt_neox")
  name = "gpt_neox.layers.0.attention.query_key_value.weight"
  tensors[name] = tensors[name][:-8]
  with pytest.raises(hf.HFConversionError, match=f"{name} has shape \\(88, 32\\)"):
    hf.load_hf_decoder(_write(tmp_path, "gpt_neox", tensors))


@pytest.mark.parametrize(
  "damage, message",
  [
    ("truncate", "model.safetensors is not a readable safetensors file"),
    ("config", "config.json is not valid JSON"),
  ],
)
def test_a_damaged_file_is_one_line_naming_it(tmp_path, damage, message):
  shutil.copytree(_dir("llama"), tmp_path / "llama")
  path = tmp_path / "llama"
  if damage == "truncate":  # a download cut short
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
  else:
    (path / "config.json").write_text((path / "config.json").read_text()[:-40])
  with pytest.raises(hf.HFConversionError, match=message) as raised:
    hf.load_hf_decoder(path)
  assert str(path) in str(raised.value) and "\n" not in str(raised.value)
