"""The Hugging Face fixtures hold what an HF_DIR must hold: config.json, model.safetensors and a
tokenizer.json (made by tests/fixtures/make_hf_tokenizers.py) that fits the model's vocabulary."""

import importlib.util
import json

import pytest
from tokenizers import Tokenizer

from roformer import testing
from roformer.data.tokenizer import HFTokenizer

FIXTURE_DIRS = sorted(testing.FIXTURES.glob("hf_*_tiny"))


def _make_hf_tokenizers():
  path = testing.FIXTURES / "make_hf_tokenizers.py"
  module_spec = importlib.util.spec_from_file_location("make_hf_tokenizers", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("model_dir", FIXTURE_DIRS, ids=lambda p: p.name)
def test_fixture_tokenizer_is_the_scripts_and_fits_the_vocabulary(model_dir):
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
    p.name for p in model_dir.iterdir()
  }
  stored = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
  made = _make_hf_tokenizers().tokenizer_for(model_dir)
  assert stored.to_str() == made.to_str()
  tokenizer = HFTokenizer(stored, kind="json")
  vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
  # No special token was missing (the library would add it past the model's vocabulary).
  assert tokenizer.vocab_size == vocab_size
  text = "def f(x): return x + 1"
  assert tokenizer.decode(tokenizer.encode(text)) == text


def test_every_fixture_is_covered():
  assert [p.name for p in FIXTURE_DIRS] == [
    "hf_gpt_neox_tiny", "hf_llama_tiny", "hf_mistral_tiny", "hf_qwen2_tiny", "hf_roformer_tiny",
  ]  # fmt: skip
