"""LongRoPE as a RoPE scaling kind: frequencies and attention factor against a hand computation of
Hugging Face's `longrope` definition, the short/long switch at the original length (also traced
inside jit), and a Hugging Face config.json with rope_type 'longrope' imported."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer import hf, testing
from roformer.posenc.config import RopeScaling
from roformer.posenc.rope_scaling import rope_frequencies

D, BASE, L0 = 8, 10000.0, 64
SHORT = (1.0, 1.1, 1.3, 1.7)
LONG = (1.0, 2.0, 5.0, 9.0)


def _scaling(**fields):
  return RopeScaling(
    kind="longrope", factor=16.0, original_max_len=L0, short_factor=SHORT, long_factor=LONG,
    **fields,
  )  # fmt: skip


def _hand(factors):
  # theta_i = 1 / (ext_i * b^(2i/d)); attention factor sqrt(1 + ln(s) / ln(L0)).
  inv_freq = 1.0 / (np.asarray(factors) * BASE ** (np.arange(0, D, 2) / D))
  return inv_freq, math.sqrt(1 + math.log(16.0) / math.log(L0))


@pytest.mark.parametrize("seq_len, factors", [(None, SHORT), (L0, SHORT), (L0 + 1, LONG)])
def test_longrope_frequencies_equal_hand_computation(seq_len, factors):
  inv_freq, attention_factor = rope_frequencies(D, BASE, _scaling(), seq_len=seq_len)
  want_freq, want_factor = _hand(factors)
  np.testing.assert_allclose(np.asarray(inv_freq), want_freq, rtol=1e-6)
  assert attention_factor == pytest.approx(want_factor, rel=1e-12)


def test_longrope_traced_length_switches_at_the_original_length():
  @jax.jit
  def freqs(seq_len):
    return rope_frequencies(D, BASE, _scaling(), seq_len=seq_len)[0]

  np.testing.assert_allclose(np.asarray(freqs(jnp.int32(L0))), _hand(SHORT)[0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(freqs(jnp.int32(L0 + 1))), _hand(LONG)[0], rtol=1e-6)


def test_longrope_explicit_attention_factor_and_refused_lists():
  assert rope_frequencies(D, BASE, _scaling(attention_factor=1.25))[1] == 1.25
  with pytest.raises(ValueError, match="needs posenc.scaling.short_factor and long_factor"):
    rope_frequencies(D, BASE, RopeScaling(kind="longrope", factor=2.0, original_max_len=L0))
  with pytest.raises(ValueError, match="the 6 rotary dims need 3"):
    rope_frequencies(6, BASE, _scaling())


def _longrope_llama(tmp_path, original=16):
  """The tiny Llama fixture with a longrope rope_parameters of per-dimension factors."""
  path = tmp_path / "llama_longrope"
  shutil.copytree(testing.FIXTURES / "hf_llama_tiny", path)
  config = json.loads((path / "config.json").read_text())
  rng = np.random.default_rng(0)
  pairs = config["head_dim"] // 2
  config["rope_parameters"] = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": original,
    "short_factor": [float(x) for x in 1.0 + rng.random(pairs)],
    "long_factor": [float(x) for x in 1.0 + 8.0 * rng.random(pairs)],
  }
  (path / "config.json").write_text(json.dumps(config))
  return path, config


def test_hf_longrope_config_is_imported_with_its_factors(tmp_path):
  path, config = _longrope_llama(tmp_path)
  scaling = hf.load_hf_decoder(path).cfg.posenc.scaling
  params = config["rope_parameters"]
  assert scaling.kind == "longrope" and scaling.original_max_len == 16
  assert scaling.factor == 2048 / 16  # HF: max_position_embeddings / original when unset
  assert scaling.short_factor == tuple(params["short_factor"])
  assert scaling.long_factor == tuple(params["long_factor"])


@pytest.mark.parametrize("length", [12, 24])  # below and beyond the original length 16
def test_hf_longrope_logits_equal_transformers(tmp_path, length):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path, _ = _longrope_llama(tmp_path)
  tokens = np.random.default_rng(1).integers(0, 96, (2, length))
  positions = np.broadcast_to(np.arange(length), (2, length))
  ours = np.asarray(testing.forward(hf.load_hf_decoder(path), tokens, positions))
  reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  with torch.no_grad():
    theirs = reference(torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
