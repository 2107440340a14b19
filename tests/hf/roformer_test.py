"""Tests of roformer/hf/roformer.py against a tiny HF RoFormerForMaskedLM in tests/fixtures/."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from roformer import hf
from roformer.nn.model import Encoder
from roformer.posenc.config import PosEncConfig

FIXTURE = pathlib.Path(__file__).parent.parent / "fixtures" / "hf_roformer_tiny"
TOL = 1e-4


@pytest.fixture(scope="module")
def reference():
  return dict(np.load(FIXTURE / "reference.npz"))


@pytest.fixture(scope="module")
def model():
  return hf.load_hf_roformer(FIXTURE)


def _tensors():
  return dict(load_file(FIXTURE / "model.safetensors"))


def _hf_config():
  return json.loads((FIXTURE / "config.json").read_text())


def _write(tmp_path, tensors, config=None):
  """A checkpoint directory with the given tensors (and config.json, the fixture's by default)."""
  (tmp_path / "config.json").write_text(json.dumps(config or _hf_config()))
  save_file(tensors, tmp_path / "model.safetensors")
  return tmp_path


def _params(m):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m.model))}


def _assert_same_params(a, b):
  pa, pb = _params(a), _params(b)
  assert pa.keys() == pb.keys()
  for path in pa:
    np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


# ---- Parity ----


def test_load_hf_roformer_fixture_logits_match_hf_reference(model, reference):
  # The reference uses both token types, so the token-type table is exercised too.
  assert reference["token_type_ids"].any()
  logits = np.asarray(model(reference["input_ids"], reference["token_type_ids"]))
  assert logits.shape == reference["logits"].shape and logits.dtype == np.float32
  np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=TOL)


def test_load_hf_roformer_returns_encoder_with_hf_config(model):
  assert isinstance(model.model, Encoder)
  cfg = model.config
  assert (cfg.kind, cfg.emb_dim, cfg.embedding_size, cfg.num_layers, cfg.num_heads) == (
    "encoder",
    32,
    24,
    2,
    4,
  )
  assert (cfg.mlp_dim, cfg.vocab_size, cfg.type_vocab_size, cfg.norm_eps) == (64, 101, 2, 1e-12)
  assert (cfg.posenc.kind, cfg.posenc.rope_layout, cfg.posenc.max_wavelength) == (
    "rope",
    "interleaved",
    10000.0,
  )
  assert not cfg.pre_norm and cfg.use_bias and cfg.tie_embeddings
  assert model.max_position_embeddings == 64


def test_load_hf_roformer_without_token_types_uses_type_zero(model, reference):
  ids = reference["input_ids"]
  zeros = np.zeros_like(reference["token_type_ids"])
  np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(model(ids, zeros)), atol=1e-6)
  # ... and token types do change the logits, so the reference test above checks their mapping.
  assert np.abs(np.asarray(model(ids)) - reference["logits"]).max() > 1e-2


def test_load_hf_roformer_half_rope_layout_logits_differ(reference):
  # The parity test is sensitive to the RoPE layout: HF rotates adjacent pairs (2i, 2i+1).
  half = hf.load_hf_roformer(FIXTURE, posenc=PosEncConfig(kind="rope", rope_layout="half"))
  logits = np.asarray(half(reference["input_ids"], reference["token_type_ids"]))
  assert np.abs(logits - reference["logits"]).max() > 1e-2


# ---- Bad checkpoints ----


def test_load_hf_roformer_missing_tensor_raises_naming_it(tmp_path):
  tensors = _tensors()
  name = "roformer.encoder.layer.1.attention.self.key.bias"
  del tensors[name]
  with pytest.raises(hf.HFConversionError, match=f"lacks 1 tensor.*{name}"):
    hf.load_hf_roformer(_write(tmp_path, tensors))


@pytest.mark.parametrize(
  "name, corrupt, message",
  [
    ("roformer.embeddings_project.weight", lambda a: a.T, r"has shape \(24, 32\), .* \(32, 24\)"),
    ("roformer.encoder.layer.0.output.dense.weight", lambda a: a[:, :-1], r"has shape \(32, 63\)"),
    ("cls.predictions.transform.LayerNorm.bias", lambda a: a * np.nan, "NaN or inf"),
    ("roformer.encoder.embed_positions.weight", lambda a: a[:, ::-1], "sinusoidal table"),
  ],
)
def test_load_hf_roformer_corrupted_tensor_raises_naming_it(tmp_path, name, corrupt, message):
  tensors = _tensors()
  tensors[name] = np.ascontiguousarray(corrupt(tensors[name]))
  with pytest.raises(hf.HFConversionError, match=f"{name}.*{message}"):
    hf.load_hf_roformer(_write(tmp_path, tensors))


def test_load_hf_roformer_unused_tensor_raises_naming_it(tmp_path):
  tensors = _tensors()
  tensors["roformer.encoder.layer.2.output.dense.bias"] = np.zeros(32, np.float32)
  with pytest.raises(hf.HFConversionError, match=r"no place .*layer\.2\.output\.dense\.bias"):
    hf.load_hf_roformer(_write(tmp_path, tensors))


def test_load_hf_roformer_posenc_with_parameters_raises_naming_them():
  # A learned position table has no counterpart in an HF RoFormer checkpoint.
  with pytest.raises(hf.HFConversionError, match=r"posenc\.table has no HF counterpart"):
    hf.load_hf_roformer(FIXTURE, posenc=PosEncConfig(kind="learned", max_len=64))


def test_load_hf_roformer_without_safetensors_raises(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(_hf_config()))
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(hf.HFConversionError, match="no model.safetensors.*pytorch_model.bin"):
    hf.load_hf_roformer(tmp_path)


@pytest.mark.parametrize(
  "change, message",
  [
    ({"rotary_value": True}, "rotary_value"),
    ({"hidden_act": "gelu_new"}, r"hidden_act='gelu_new'.*\['gelu'\]"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"is_decoder": True}, "is_decoder"),
    ({"model_type": "bert"}, "model_type"),
    ({"num_attention_heads": 5}, "num_attention_heads=5"),
  ],
)
def test_hf_config_to_model_config_unsupported_config_raises(change, message):
  with pytest.raises(hf.HFConversionError, match=message):
    hf.hf_config_to_model_config({**_hf_config(), **change})


def test_hf_config_to_model_config_override_of_shape_field_raises():
  with pytest.raises(hf.HFConversionError, match=r"\['num_layers'\]"):
    hf.hf_config_to_model_config(_hf_config(), num_layers=3)


def test_hf_config_to_model_config_equal_embedding_size_means_no_projection():
  cfg = hf.hf_config_to_model_config({**_hf_config(), "embedding_size": 32})
  assert cfg.embedding_size == 0 and cfg.emb_dim == 32


# ---- Other checkpoint forms ----


def test_load_hf_roformer_tied_decoder_tensors_checked_against_their_source(tmp_path, model):
  tensors = _tensors()
  tensors["cls.predictions.decoder.weight"] = tensors["roformer.embeddings.word_embeddings.weight"]
  tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
  _assert_same_params(hf.load_hf_roformer(_write(tmp_path, tensors)), model)
  tensors["cls.predictions.decoder.weight"] = tensors["cls.predictions.decoder.weight"] + 1.0
  with pytest.raises(hf.HFConversionError, match="decoder.weight differs from .*word_embeddings"):
    hf.load_hf_roformer(_write(tmp_path, tensors))


def test_load_hf_roformer_untied_decoder_becomes_head_decoder(tmp_path, model):
  tensors = _tensors()
  decoder_VE = np.random.default_rng(0).normal(size=(101, 24)).astype(np.float32)
  tensors["cls.predictions.decoder.weight"] = decoder_VE
  m = hf.load_hf_roformer(_write(tmp_path, tensors, {**_hf_config(), "tie_word_embeddings": False}))
  assert not m.config.tie_embeddings
  np.testing.assert_array_equal(np.asarray(m.model.head_decoder.kernel[...]), decoder_VE.T)
  word_VE = tensors["roformer.embeddings.word_embeddings.weight"]
  np.testing.assert_array_equal(np.asarray(m.model.embed.embedding[...]), word_VE)


def test_load_hf_roformer_sharded_checkpoint_loads_same_params(tmp_path, model):
  shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
  tensors = _tensors()
  names = sorted(tensors)
  weight_map = {}
  for i, part in enumerate((names[::2], names[1::2])):
    file = f"model-{i + 1:05d}-of-00002.safetensors"
    save_file({n: tensors[n] for n in part}, tmp_path / file)
    weight_map.update(dict.fromkeys(part, file))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  _assert_same_params(hf.load_hf_roformer(tmp_path), model)


def test_load_hf_roformer_bfloat16_checkpoint_loads_rounded_weights(tmp_path, model):
  shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
  bf16 = {n: a.astype(ml_dtypes.bfloat16) for n, a in _tensors().items()}
  save_file(bf16, tmp_path / "model.safetensors")
  loaded = _params(hf.load_hf_roformer(tmp_path))
  expected = jax.tree.map(
    lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32), _params(model)
  )
  for path, value in loaded.items():
    assert value.dtype == np.float32
    np.testing.assert_array_equal(value, expected[path], err_msg=str(path))


def test_load_hf_roformer_gamma_beta_names_load_same_params(tmp_path, model):
  tensors = {}
  for name, value in _tensors().items():
    if ".LayerNorm." in name:
      name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
    tensors[name] = value
  _assert_same_params(hf.load_hf_roformer(_write(tmp_path, tensors)), model)
