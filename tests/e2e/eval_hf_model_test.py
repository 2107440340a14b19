"""eval.py --hf_model: perplexity against length for a Hugging Face causal LM directory, with its
tokenizer.json, every flag of a run's evaluation, and results named and plotted like a run's."""

import json
import shutil

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models

from roformer import data, hf, runs, testing
from roformer.evals import ppl_vs_length, spec

# A character-level tokenizer of 96 entries (the fixtures' vocabulary), the special tokens first.
SPECIALS = ["<pad>", "</s>", "<mask>", "<s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 123)]  # " " .. "z": 91 characters


def _tokenizer_json(specials=SPECIALS) -> str:
  vocab = {t: i for i, t in enumerate([*specials, *CHARS])}
  return Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).to_str()


def _text(path, seed, lines=40):
  rng = np.random.default_rng(seed)
  words = ["def", "return", "self", "import", "for", "in", "if", "x", "value", "print"]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(lines)) + "\n")
  return path


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
  """The Llama fixture with a tokenizer.json, a text file to score and a private token cache."""
  monkeypatch.setenv("ROFORMER_CACHE", str(tmp_path / "cache"))
  path = tmp_path / "llama"
  shutil.copytree(testing.FIXTURES / "hf_llama_tiny", path)
  (path / "tokenizer.json").write_text(_tokenizer_json())
  _text(tmp_path / "text" / "a.txt", 0)
  return path


def _evaluate(out, hf_model, **options):
  options = dict(
    dict(lengths=[16, 32], max_tokens=64, batch_size=2, data_files=str(out.parent / "text/*.txt")),
    **options,
  )
  return ppl_vs_length.evaluate_workdir(
    out, spec.spec_from_options(**options), log=lambda _: None, hf_model=str(hf_model)
  )


def test_hf_model_is_scored_like_a_run_and_equals_its_own_forward_pass(hf_dir):
  result, path = _evaluate(hf_dir, hf_dir, protocol="nonoverlapping")
  assert path == hf_dir / "eval" / "ppl_vs_length_files_len16-32_nonoverlapping_tok64.json"
  assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
  written = json.loads(path.read_text())
  assert (written["step"], written["hf_model"], written["posenc"]) == (0, str(hf_dir), "rope")
  assert written["rope_scaling"] == {"kind": "llama3", "factor": 8.0}
  assert [r["tokens"] for r in written["records"]] == [64, 64]
  # The length-16 loss is the imported decoder's mean next-token loss on the same windows.
  run_config, _ = runs.open_hf_model(hf_dir)
  tokens, tokenizer = ppl_vs_length.load_eval_tokens(
    run_config, hf_dir, data_files=str(hf_dir.parent / "text/*.txt")
  )
  w = data.eval_windows(
    tokens, model_kind="decoder", length=16, protocol="nonoverlapping", stride=16,
    max_tokens=64, max_length=32, tokenizer=tokenizer,
  )  # fmt: skip
  logits = testing.forward(hf.load_hf_decoder(hf_dir), w.inputs, w.positions)
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  nll = -np.take_along_axis(np.asarray(logp), w.targets[..., None], axis=-1)[..., 0]
  want = float((nll * w.weights).sum() / w.weights.sum())
  assert written["records"][0]["loss"] == pytest.approx(want, rel=1e-5)
  assert run_config.data.seq_len == 2048  # the checkpoint's max_position_embeddings


def test_hf_model_rope_scaling_override_and_output_directory(hf_dir, tmp_path):
  out = tmp_path / "out"
  plain, _ = _evaluate(out, hf_dir, lengths=[32], protocol="nonoverlapping")
  scaled, path = _evaluate(
    out, hf_dir, lengths=[32], protocol="nonoverlapping", rope_scaling="linear", rope_factor=4.0
  )
  assert path == out / "eval" / "ppl_vs_length_files_len32_nonoverlapping_tok64_linear_4.json"
  # Only results are written: the model's tokenizer is read where it is, not copied.
  assert sorted(p.name for p in out.iterdir()) == ["eval"] and not (hf_dir / "eval").exists()
  assert scaled["rope_scaling"] == {"kind": "linear", "factor": 4.0}
  assert scaled["records"][0]["loss"] != plain["records"][0]["loss"]


def test_hf_model_without_tokenizer_json_is_refused(hf_dir):
  (hf_dir / "tokenizer.json").unlink()
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    _evaluate(hf_dir, hf_dir)


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused(hf_dir):
  # Without an end-of-text token, one is added as id 96: the model has no embedding for it.
  (hf_dir / "tokenizer.json").write_text(_tokenizer_json(["<pad>", "<mask>", "<s>", "<unk>", "~"]))
  with pytest.raises(ValueError, match="gives id 96, beyond the model's vocabulary of 96"):
    _evaluate(hf_dir, hf_dir)


def _run_cli(*args):
  return testing.run_script("eval.py", *args)


def test_eval_cli_hf_model_writes_its_result_and_refuses_step(hf_dir, tmp_path):
  text = str(hf_dir.parent / "text/*.txt")
  done = _run_cli(
    f"--hf_model={hf_dir}", f"--out_dir={tmp_path / 'out'}", "--lengths=16", "--max_tokens=32",
    "--protocol=sliding", f"--data_files={text}", "--rope_scaling=yarn", "--rope_factor=auto",
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  written = json.loads(
    (tmp_path / "out" / "ppl_vs_length_files_len16_sliding_tok32_yarn_auto.json").read_text()
  )
  assert written["records"][0]["protocol"] == "sliding" and written["hf_model"] == str(hf_dir)
  assert not (hf_dir / "eval").exists()
  refused = _run_cli(f"--hf_model={hf_dir}", f"--out_dir={tmp_path / 'out'}", "--step=3")
  assert refused.returncode == 1
  assert refused.stderr.strip().splitlines()[-1] == (
    "eval.py: error: --step is not read with --hf_model (one set of weights, perplexity evaluation)"
  )
