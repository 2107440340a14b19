"""eval.py --extend=KIND: training-free context extensions evaluated on an imported decoder
(the tiny Llama fixture): named and recorded results, the blockwise and dense model paths equal,
positive and negative controls, and the CLI's flag checks."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from roformer import runs, testing
from roformer.evals import ppl_vs_length, spec
from roformer.posenc.config import ContextExtension

SPECIALS = ["<pad>", "</s>", "<mask>", "<s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 123)]  # the fixture's 96-entry vocabulary with SPECIALS


def _tokenizer_json() -> str:
  vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
  return Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).to_str()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("extend")
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("ROFORMER_CACHE", str(root / "cache"))
    yield _hf_dir(root)


def _hf_dir(root):
  """The Llama fixture with a tokenizer.json, beside a text file to score."""
  path = root / "llama"
  shutil.copytree(testing.FIXTURES / "hf_llama_tiny", path)
  (path / "tokenizer.json").write_text(_tokenizer_json())
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "import", "for", "in", "if", "x", "value", "print"]
  text = root / "text" / "a.txt"
  text.parent.mkdir()
  text.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(40)) + "\n")
  return path


def _evaluate(hf_dir, **options):
  options = dict(
    dict(
      lengths=[32], protocol="nonoverlapping", max_tokens=64, batch_size=2,
      data_files=str(hf_dir.parent / "text/*.txt"),
    ),
    **options,
  )  # fmt: skip
  result, path = ppl_vs_length.evaluate_workdir(
    hf_dir, spec.spec_from_options(**options), log=lambda _: None, hf_model=str(hf_dir),
    overwrite=True,
  )  # fmt: skip
  return result["records"][0]["loss"], result, path


def test_extend_result_is_named_recorded_and_differs_from_plain_rope(hf_dir):
  plain, _, _ = _evaluate(hf_dir)
  loss, result, path = _evaluate(
    hf_dir, extend="self_extend", extend_fields=dict(window=4, group=2)
  )
  assert path.name == (
    "ppl_vs_length_files_len32_nonoverlapping_tok64_self_extend_window4_group2.json"
  )
  written = json.loads(path.read_text())
  assert written["context_extension"] == dataclasses.asdict(
    ContextExtension("self_extend", window=4, group=2)
  )
  assert "self_extend (window 4, group 2)" in written["notes"]
  assert loss != plain


@pytest.mark.parametrize(
  "kind, fields, shorter",
  [
    # Every distance < W: the neighbour piece only. W = 16 groups the far keys.
    ("self_extend", dict(window=32, group=4), dict(window=16, group=4)),
    # Distances reach 31 = w, so min(d, w) = d; w = 30 moves the pair (31, 0).
    ("rerope", dict(window=31), dict(window=30)),
    # No distance reaches S = 32; S = 31 shifts the pair (31, 0) to distance 4.
    ("string", dict(shift=32, local=4), dict(shift=31, local=4)),
    # The recent window holds every key; a window of 30 drops key 1 for query 31.
    ("sinks", dict(sinks=1, window=32), dict(sinks=1, window=30)),
    # One chunk: intra-chunk positions are the positions; chunks of 16 remap the second half.
    ("dca", dict(chunk=32, local=2), dict(chunk=16, local=2)),
  ],
)
def test_extend_that_covers_the_window_equals_plain_rope_and_a_shorter_one_does_not(
  hf_dir, kind, fields, shorter
):
  plain, _, _ = _evaluate(hf_dir)
  same, _, _ = _evaluate(hf_dir, extend=kind, extend_fields=fields)
  assert same == pytest.approx(plain, rel=1e-6, abs=0)
  other, _, _ = _evaluate(hf_dir, extend=kind, extend_fields=shorter)
  assert other != pytest.approx(plain, rel=1e-6, abs=0)


EXTENSIONS = [
  ContextExtension("self_extend", window=6, group=3),
  ContextExtension("dca", chunk=10, local=3),
  ContextExtension("rerope", window=7),
  ContextExtension("string", shift=12, local=3),
  ContextExtension("sinks", sinks=2, window=9),
]


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.kind)
def test_extended_decoder_blockwise_equals_dense(hf_dir, ext):
  run_config, decoder = runs.open_hf_model(hf_dir)
  cfg = runs.eval_model_config(run_config.model, seq_len=2048, extension=ext)
  tokens = np.random.default_rng(1).integers(5, 96, (2, 45))
  positions = np.broadcast_to(np.arange(45), (2, 45))
  logits = {}
  for impl in ("dense", "chunked"):
    impl_cfg = dataclasses.replace(cfg, attention_impl=impl, attention_block=8)
    model = runs.with_config(decoder, impl_cfg)
    logits[impl] = np.asarray(testing.forward(model, tokens, positions))
  np.testing.assert_allclose(logits["chunked"], logits["dense"], atol=1e-5, rtol=0)
  plain = np.asarray(testing.forward(decoder, tokens, positions))
  assert np.abs(logits["dense"] - plain).max() > 1e-4


def _run_cli(*args):
  return testing.run_script("eval.py", *args)


def test_eval_cli_extend_writes_its_result_and_refuses_unread_numbers(hf_dir, tmp_path):
  common = (
    f"--hf_model={hf_dir}", f"--out_dir={tmp_path}", "--lengths=32", "--max_tokens=64",
    "--protocol=nonoverlapping", f"--data_files={hf_dir.parent / 'text/*.txt'}",
  )  # fmt: skip
  done = _run_cli(*common, "--extend=rerope", "--extend_window=8")
  assert done.returncode == 0, done.stderr
  path = tmp_path / "ppl_vs_length_files_len32_nonoverlapping_tok64_rerope_window8.json"
  assert json.loads(path.read_text())["context_extension"]["kind"] == "rerope"
  refused = _run_cli(*common, "--extend=rerope", "--extend_window=8", "--extend_group=2")
  assert refused.returncode == 1
  assert "--extend_group is not read by --extend=rerope" in refused.stderr
  missing = _run_cli(*common, "--extend=dca")
  assert missing.returncode == 1 and "--extend_chunk >= 1" in missing.stderr
