"""generate.py --hf_model and roformer.generate on imported Hugging Face decoders: greedy tokens
equal repeated full forward passes for Llama (GQA), GPT-NeoX (parallel residual, partial rotary)
and Mistral (a sliding window of 5, shorter than the generation: the cache's ring buffer), through
the Python API and the CLI; and the CLI's flag checks."""

import dataclasses
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from roformer import generate as gen
from roformer import hf, runs, testing
from roformer.data.tokenizer import HFTokenizer
from roformer.posenc.config import ContextExtension

# A character-level tokenizer of the fixtures' 96 ids, the special tokens first; decoding
# concatenates the characters, so a text names its tokens.
SPECIALS = ["<pad>", "</s>", "<mask>", "<s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 123)]  # " " .. "z": 91 characters
FAMILIES = ["llama", "gpt_neox", "mistral"]
PROMPT, NEW_TOKENS = "def f(x):", 12  # 9 + 12 positions, past Mistral's window of 5


def _tokenizer() -> Tokenizer:
  vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  tok.decoder = decoders.Fuse()
  return tok


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """Each family's fixture with a tokenizer.json."""
  root = tmp_path_factory.mktemp("hf_generate")
  dirs = {}
  for family in FAMILIES:
    path = root / family
    shutil.copytree(testing.FIXTURES / f"hf_{family}_tiny", path)
    (path / "tokenizer.json").write_text(_tokenizer().to_str())
    dirs[family] = path
  return dirs


def _prompt_ids() -> list[int]:
  return HFTokenizer(_tokenizer(), kind="json").encode(PROMPT)


def _greedy_by_full_forward(model, ids: list[int], n: int) -> list[int]:
  """n greedy tokens, each the argmax of the last logits of a full forward pass over the
  sequence so far (no cache)."""
  tokens = list(ids)
  for _ in range(n):
    L = len(tokens)
    logits_1LV = testing.forward(
      model, jnp.asarray([tokens], jnp.int32), testing.arange_positions(1, L)
    )
    tokens.append(int(jnp.argmax(logits_1LV[0, -1])))
  return tokens[len(ids) :]


@pytest.fixture(scope="module")
def references(hf_dirs):
  """Each family's greedy continuation of PROMPT by full forward passes of the imported model."""
  ids = _prompt_ids()
  return {
    f: _greedy_by_full_forward(hf.load_hf_decoder(d), ids, NEW_TOKENS) for f, d in hf_dirs.items()
  }


def _text(ids: list[int]) -> str:
  return HFTokenizer(_tokenizer(), kind="json").decode(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_of_an_imported_decoder_equals_full_forward_passes(
  hf_dirs, references, family
):
  ids = _prompt_ids()
  want = references[family]
  tokens_BT = gen.generate(
    hf.load_hf_decoder(hf_dirs[family]), np.asarray([ids], np.int32), max_new_tokens=NEW_TOKENS
  )
  assert np.asarray(tokens_BT[0]).tolist() == ids + want
  text = gen.generate_text(None, PROMPT, hf_model=str(hf_dirs[family]), max_new_tokens=NEW_TOKENS)
  assert text == _text(want)
  # Nothing is written beside the imported model.
  assert sorted(p.name for p in hf_dirs[family].iterdir()) == sorted(
    {p.name for p in (testing.FIXTURES / f"hf_{family}_tiny").iterdir()} | {"tokenizer.json"}
  )


def test_mistral_window_changes_the_continuation_it_is_generated_with(hf_dirs, references):
  # Negative control: the same weights attending to every earlier key give other logits, so the
  # reference above depends on the sliding window (and the ring buffer reproduces it).
  model = hf.load_hf_decoder(hf_dirs["mistral"])
  assert model.cfg.attention_window == 5
  full = runs.with_config(model, dataclasses.replace(model.cfg, attention_window=0))
  tokens_1L = jnp.asarray([_prompt_ids() + references["mistral"]], jnp.int32)
  positions_1L = testing.arange_positions(1, tokens_1L.shape[1])
  windowed = np.asarray(testing.forward(model, tokens_1L, positions_1L))
  unwindowed = np.asarray(testing.forward(full, tokens_1L, positions_1L))
  np.testing.assert_allclose(windowed[:, :5], unwindowed[:, :5], rtol=1e-5, atol=1e-5)
  assert np.abs(windowed[:, 5:] - unwindowed[:, 5:]).max() > 1e-2


def test_generate_text_applies_a_rope_scaling_to_an_imported_decoder(hf_dirs, references):
  # PI (linear, factor 8) replaces the checkpoint's RoPE: the generation equals greedy full
  # forward passes of the scaled model.
  path = hf_dirs["gpt_neox"]
  run_config, model = runs.open_hf_model(path)
  cfg = runs.eval_model_config(run_config.model, seq_len=64, rope_scaling="linear", rope_factor=8.0)
  want = _greedy_by_full_forward(runs.with_config(model, cfg), _prompt_ids(), NEW_TOKENS)
  got = gen.generate_text(
    None, PROMPT, hf_model=str(path), max_new_tokens=NEW_TOKENS, rope_scaling="linear",
    rope_factor=8.0,
  )  # fmt: skip
  assert got == _text(want)
  assert want != references["gpt_neox"]  # the scaling does change the continuation


def test_generate_text_with_attention_sinks_on_an_imported_decoder(hf_dirs, references):
  # StreamingLLM's cache (2 sinks, 6 recent keys) equals full forward passes of the extended
  # model, whose every query sees the same keys; the plain continuation is another.
  path, ext = hf_dirs["llama"], ContextExtension("sinks", sinks=2, window=6)
  run_config, model = runs.open_hf_model(path)
  cfg = runs.eval_model_config(run_config.model, seq_len=2048, extension=ext)
  want = _greedy_by_full_forward(runs.with_config(model, cfg), _prompt_ids(), NEW_TOKENS)
  got = gen.generate_text(
    None, PROMPT, hf_model=str(path), max_new_tokens=NEW_TOKENS, extension=ext
  )
  assert got == _text(want)
  assert want != references["llama"]


def test_generate_text_refuses_a_prompt_beyond_the_model_vocabulary(hf_dirs, tmp_path):
  path = tmp_path / "llama"
  shutil.copytree(hf_dirs["llama"], path)
  # "{" is id 96 of this tokenizer: the model has no embedding for it.
  vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS, "{"])}
  (path / "tokenizer.json").write_text(
    Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).to_str()
  )
  with pytest.raises(ValueError, match="prompt id 96, beyond the model's vocabulary of 96"):
    gen.generate_text(None, "x{", hf_model=str(path), max_new_tokens=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_text_is_the_greedy_continuation_of_an_imported_decoder(
  hf_dirs, references, family
):
  """What generate.py prints: the text of the greedy tokens of full forward passes."""
  text = gen.generate_text(None, PROMPT, hf_model=str(hf_dirs[family]), max_new_tokens=NEW_TOKENS)
  assert text == _text(references[family])


@pytest.mark.slow
def test_cli_prints_the_greedy_continuation_of_an_imported_decoder(hf_dirs, references):
  proc = testing.run_script(
    "generate.py", f"--hf_model={hf_dirs['llama']}", f"--prompt={PROMPT}",
    f"--max_new_tokens={NEW_TOKENS}",
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout == _text(references["llama"]) + "\n"


@pytest.mark.parametrize(
  "args, error",
  [
    ([], "give --workdir=DIR (a run) or --hf_model=HF_DIR (a Hugging Face decoder), one of them"),
    (
      ["--workdir=/tmp/run", "--hf_model=HF"],
      "give --workdir=DIR (a run) or --hf_model=HF_DIR (a Hugging Face decoder), one of them",
    ),
    (
      ["--hf_model=HF", "--step=3"],
      "--step is not read with --hf_model (one set of weights, no checkpoints)",
    ),
    (
      ["--hf_model=HF", "--top_k=4"],
      "--top_k applies to sampling; it is not read at --temperature=0 (greedy)",
    ),
    (["--hf_model=HF", "--rope_factor=2"], "--rope_factor=2.0 needs --rope_scaling=KIND"),
  ],
)
def test_cli_refuses_a_flag_combination_with_one_line_naming_the_flag(hf_dirs, args, error):
  args = [a.replace("=HF", f"={hf_dirs['llama']}") for a in args]
  cli = testing.load_script("generate.py")
  cli.FLAGS.unparse_flags()
  try:
    cli.FLAGS(["generate.py", "--prompt=x", *args])
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["generate.py"])
  finally:
    cli.FLAGS.unparse_flags()
  assert exit_info.value.code == f"generate.py: error: {error}"


def test_a_refused_flag_combination_is_one_line_on_stderr_and_exit_1(hf_dirs):
  """The exit the in-process cases above raise, as a user's shell sees it."""
  proc = testing.run_script(
    "generate.py", "--prompt=x", f"--hf_model={hf_dirs['llama']}", "--step=3"
  )
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if "error" in line]
  assert errors == [
    "generate.py: error: --step is not read with --hf_model (one set of weights, no checkpoints)"
  ], proc.stderr
