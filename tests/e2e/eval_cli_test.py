"""Tests of eval.py and its driver (evals.ppl_vs_length, evals.plots): workdirs, JSON schema,
scaling, plots."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from absl import flags
from flax import nnx

from configs import default
from roformer import config as config_lib
from roformer import runs, testing
from roformer.evals import ppl_vs_length, results, spec
from roformer.evals.effective_length import EffectiveRule, perplexity_effective_lengths
from roformer.infra import checkpoint, compile_cache, cpu_flags
from roformer.nn.model import make_model
from roformer.testing import REPO
from roformer.train import loop as train_loop

SEQ_LEN = 32
JSON_KEYS = {
  "step", "posenc", "rope_scaling", "attention_window", "notes", "split", "max_tokens",
  "positions", "records", "per_position", "effective_length",
}  # fmt: skip


def _write_text(path: Path, seed: int, lines: int = 60):
  rng = np.random.default_rng(seed)
  words = ["def", "return", "self", "import", "for", "in", "if", "x", "value", "print", "(", ")"]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(lines)) + "\n")


def _make_run(root: Path, name: str, *, model_kind: str = "decoder", **posenc) -> Path:
  """A workdir with config.json and a step-7 checkpoint of a randomly initialised tiny model."""
  _write_text(root / "text" / "train.txt", 0)
  _write_text(root / "text" / "valid.txt", 1)
  config = default.get_config()
  config.model.kind = model_kind
  config.model.num_layers = 1
  config.model.emb_dim = 16
  config.model.num_heads = 2
  config.model.mlp_dim = 32
  config.model.attention_block = 64
  for field, value in posenc.items():
    config.posenc[field] = value
  config.data.source = "files"
  config.data.files = str(root / "text" / "train.txt")
  config.data.validation_files = str(root / "text" / "valid.txt")
  config.data.cache_dir = str(root / "cache")
  config.data.seq_len = SEQ_LEN
  run_config = config_lib.run_config_from_dict(config, vocab_size=261)
  workdir = root / name
  config_lib.write_config_json(workdir, run_config)
  model = make_model(run_config.model, rngs=nnx.Rngs(0))
  manager = checkpoint.make_manager(workdir)
  checkpoint.save(manager, 7, nnx.state(model), {"unused": np.zeros(1)}, {"step": 7})
  manager.wait_until_finished()
  manager.close()
  return workdir


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
  return _make_run(tmp_path_factory.mktemp("runs"), "rope_run")


def _evaluate(workdir, *, step=None, overwrite=False, log=lambda _: None, **options):
  options = dict(dict(lengths=[32, 64], max_tokens=128, batch_size=2), **options)
  return ppl_vs_length.evaluate_workdir(
    workdir, spec.spec_from_options(**options), step=step, overwrite=overwrite, log=log
  )


def _run_cli(*args):
  return testing.run_script("eval.py", *args)


def test_evaluate_workdir_writes_design_schema_json_and_png(rope_run):
  lines = []
  result, path = _evaluate(rope_run, log=lines.append)
  assert path == rope_run / "eval" / "ppl_vs_length_len32-64_tok128.json"
  written = json.loads(path.read_text())
  assert written == json.loads(json.dumps(result))
  assert set(written) == JSON_KEYS
  assert written["step"] == 7
  assert written["posenc"] == "rope"
  assert written["rope_scaling"] is None
  assert written["split"] == "validation"
  records = written["records"]
  assert [(r["length"], r["protocol"]) for r in records] == [
    (32, "nonoverlapping"),
    (32, "sliding"),
    (64, "nonoverlapping"),
    (64, "sliding"),
  ]
  assert written["notes"] == ["stride L/4"] and written["attention_window"] is None
  for r in records:
    sliding = {"stride"} if r["protocol"] == "sliding" else set()
    assert set(r) == {"length", "protocol", "loss", "ppl", "tokens"} | sliding
    assert r.get("stride", r["length"] // 4) == r["length"] // 4
    assert r["ppl"] == pytest.approx(np.exp(r["loss"]))
  assert {r["tokens"] for r in records} == {128}
  assert written["per_position"]["length"] == 64
  assert len(written["per_position"]["loss"]) == 64
  assert all(np.isfinite(written["per_position"]["loss"]))
  assert (rope_run / "eval" / "ppl_vs_length_len32-64_tok128.png").read_bytes()[:4] == b"\x89PNG"
  assert any("length 2/2" in line and "tokens/s" in line for line in lines)
  # The effective length of each protocol, read from the training length 32 up.
  effective = written["effective_length"]
  assert effective == json.loads(
    json.dumps(perplexity_effective_lengths(records, EffectiveRule(), train_length=SEQ_LEN))
  )
  assert set(effective) == {"rule", "nonoverlapping", "sliding"}
  assert effective["nonoverlapping"]["reference_length"] == SEQ_LEN
  assert sum(line.startswith("effective length (") for line in lines) == 2


def test_evaluate_workdir_key_tokens_add_longppl_to_nonoverlapping_records(rope_run):
  lines = []
  result, path = _evaluate(rope_run, key_tokens=True, key_short_window=8, log=lines.append)
  assert path.name == "ppl_vs_length_len32-64_tok128_keytok8.json"
  assert result["key_tokens"]["short_window"] == 8 and result["key_tokens"]["chunk"] == 2
  assert "own model" in result["key_tokens"]["evaluator"]
  flat = [r for r in result["records"] if r["protocol"] == "nonoverlapping"]
  assert all("key_tokens" not in r for r in result["records"] if r["protocol"] == "sliding")
  # Candidates: the targets from slot K + S = 10 on of each window of 128 targets.
  assert [r["key_tokens"]["candidates"] for r in flat] == [4 * (32 - 10), 2 * (64 - 10)]
  for r in flat:
    found = r["key_tokens"]
    assert 0 <= found["count"] <= found["candidates"]
    assert found["ppl"] is None or found["ppl"] <= math.exp(2.0)  # the LCL condition's bound
  assert sum("key tokens of" in line for line in lines) == 2
  # The default short window is a quarter of the training length.
  default_k, _ = _evaluate(rope_run, lengths=[64], protocol="nonoverlapping", key_tokens=True)
  assert default_k["key_tokens"]["short_window"] == SEQ_LEN // 4


@pytest.mark.parametrize(
  ("options", "match"),
  [
    (dict(key_short_window=8), "--key_short_window=8 needs --key_tokens"),
    (dict(key_tokens=True, protocol="sliding"), "--key_tokens scores the non-overlapping"),
    (dict(key_tokens=True, key_short_window=-1), "--key_short_window must be >= 0"),
  ],
)
def test_key_token_options_that_cannot_work_are_one_error(options, match):
  with pytest.raises(ValueError, match=match):
    spec.spec_from_options(**options)


def test_key_tokens_refuse_encoders_and_randomized_positions(tmp_path):
  encoder = _make_run(tmp_path, "encoder_run", model_kind="encoder")
  with pytest.raises(ValueError, match="decoders only"):
    _evaluate(encoder, key_tokens=True)
  randomized = _make_run(tmp_path, "randomized_run", randomize_max=64)
  with pytest.raises(ValueError, match="randomized positions"):
    _evaluate(randomized, key_tokens=True)


def test_evaluate_workdir_rope_scaling_writes_a_separate_file(rope_run):
  plain, plain_path = _evaluate(rope_run, lengths=[64], protocol="nonoverlapping")
  scaled, path = _evaluate(
    rope_run, lengths=[64], protocol="nonoverlapping", rope_scaling="linear", rope_factor=2.0
  )
  assert path.name == "ppl_vs_length_len64_nonoverlapping_tok128_linear_2.json"
  assert (rope_run / "eval" / "ppl_vs_length_len64_nonoverlapping_tok128_linear_2.png").exists()
  assert json.loads(plain_path.read_text()) == json.loads(json.dumps(plain))
  assert scaled["rope_scaling"] == {"kind": "linear", "factor": 2.0}
  # Same weights, other frequencies: a different loss on the same tokens.
  assert scaled["records"][0]["tokens"] == plain["records"][0]["tokens"]
  assert scaled["records"][0]["loss"] != plain["records"][0]["loss"]


def test_evaluate_workdir_data_files_use_the_run_tokenizer(rope_run, tmp_path):
  _write_text(tmp_path / "other" / "a.txt", 5, lines=30)
  result, path = _evaluate(
    rope_run, lengths=[32], protocol="nonoverlapping", data_files=str(tmp_path / "other" / "*.txt"),
    out="other_text",
  )  # fmt: skip
  assert path.name == "other_text.json"
  assert result["split"].startswith("files:")
  assert result["records"][0]["tokens"] == 128


def test_evaluate_workdir_learned_positions_skip_lengths_past_max_len(tmp_path):
  workdir = _make_run(tmp_path, "learned_run", kind="learned", max_len=SEQ_LEN)
  result, _ = _evaluate(workdir, protocol="nonoverlapping")
  evaluated, skipped = result["records"]
  assert evaluated["length"] == 32 and "loss" in evaluated
  assert skipped["length"] == 64 and set(skipped) == {"length", "protocol", "skipped"}
  assert "posenc.max_len" in skipped["skipped"]
  assert result["per_position"]["length"] == 32


def test_eval_model_config_rope_scaling_of_a_non_rope_run_raises(tmp_path):
  workdir = _make_run(tmp_path, "alibi_run", kind="alibi")
  run_config = config_lib.load_run_config(workdir)
  with pytest.raises(ValueError, match="posenc.kind"):
    runs.eval_model_config(run_config.model, seq_len=SEQ_LEN, rope_scaling="yarn")


def test_eval_cli_without_checkpoint_exits_with_one_clear_error(tmp_path):
  workdir = tmp_path / "empty_run"
  config_lib.write_config_json(workdir, config_lib.run_config_from_dict(default.get_config()))
  proc = _run_cli(f"--workdir={workdir}")
  assert proc.returncode != 0
  assert "no checkpoint" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_eval_cli_compare_writes_one_png_of_several_runs(tmp_path):
  for name, posenc, ppls in (("a", "rope", [5.0, 6.0]), ("b", "alibi", [5.5, 5.4])):
    records = [
      {"length": n, "protocol": "nonoverlapping", "loss": float(np.log(p)), "ppl": p, "tokens": 64}
      for n, p in zip((32, 64), ppls, strict=True)
    ]
    result = {
      "step": 1,
      "posenc": posenc,
      "rope_scaling": None,
      "split": "validation",
      "records": records + [{"length": 128, "protocol": "nonoverlapping", "skipped": "too long"}],
      "per_position": {"length": 64, "loss": [1.0, 2.0, None, 3.0]},
    }
    results.write_result(result, tmp_path / name / "eval" / "ppl_vs_length.json")
  plot = tmp_path / "compare.png"
  proc = _run_cli(f"--compare={tmp_path / 'a'},{tmp_path / 'b'}", f"--plot={plot}")
  assert proc.returncode == 0, proc.stderr
  assert plot.read_bytes()[:4] == b"\x89PNG"
  # An existing file is never replaced without --overwrite (here a note, not a PNG).
  note = tmp_path / "notes.md"
  note.write_text("my notes")
  refused = _run_cli(f"--compare={tmp_path / 'a'}", f"--plot={note}")
  assert refused.returncode != 0 and "Traceback" not in refused.stderr
  assert "exists; pass --overwrite" in refused.stderr and note.read_text() == "my notes"
  again = _run_cli(f"--compare={tmp_path / 'a'}", f"--plot={plot}", "--overwrite")
  assert again.returncode == 0, again.stderr
  other = tmp_path / "other.png"
  (tmp_path / "nothing").mkdir()  # a directory without results
  missing = _run_cli(f"--compare={tmp_path / 'a'},{tmp_path / 'nothing'}", f"--plot={other}")
  assert missing.returncode != 0 and "Traceback" not in missing.stderr
  assert "eval.py --workdir=" in missing.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model_kind", ["decoder", "encoder"])
def test_eval_cli_reproduces_the_training_eval_loss(tmp_path, model_kind):
  _write_text(tmp_path / "text" / "train.txt", 0, lines=200)
  _write_text(tmp_path / "text" / "valid.txt", 1, lines=60)
  workdir = tmp_path / f"{model_kind}_run"
  overrides = {
    "model.kind": model_kind,
    "model.num_layers": 1,
    "model.emb_dim": 32,
    "model.num_heads": 2,
    "model.mlp_dim": 64,
    "data.source": "files",
    "data.files": tmp_path / "text" / "train.txt",
    "data.validation_files": tmp_path / "text" / "valid.txt",
    "data.cache_dir": tmp_path / "cache",
    "data.seq_len": SEQ_LEN,
    "train.global_batch_size": 4,
    "train.num_train_steps": 12,
    "train.log_every_steps": 6,
    "train.eval_every_steps": 12,
    "train.eval_max_tokens": 256,
    "train.checkpoint_every_steps": 12,
    "train.seed": 3,  # the encoder's evaluation mask is drawn from it
    "optim.warmup_steps": 2,
  }
  # Trained in this process (train.py's own flags: train_cli_test.py), scored by eval.py's CLI.
  overrides = {k: str(v) if isinstance(v, Path) else v for k, v in overrides.items()}
  train_loop.train_and_evaluate(
    testing.config_file_with("configs/default.py", overrides), str(workdir)
  )
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  logged = [x for x in lines if "eval_loss" in x and x["step"] == 12][-1]

  proc = _run_cli(
    f"--workdir={workdir}", f"--lengths={SEQ_LEN}", "--protocol=nonoverlapping",
    "--max_tokens=256",
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(
    (workdir / "eval" / "ppl_vs_length_len32_nonoverlapping_tok256.json").read_text()
  )
  (record,) = result["records"]
  assert result["step"] == 12
  assert record["tokens"] == logged["eval_tokens"]
  assert abs(record["loss"] - logged["eval_loss"]) <= 1e-5
  if model_kind == "encoder":
    assert abs(record["accuracy"] - logged["eval_accuracy"]) <= 1e-5
  png = workdir / "eval" / "ppl_vs_length_len32_nonoverlapping_tok256.png"
  assert png.read_bytes()[:4] == b"\x89PNG"


def test_evaluate_workdir_refuses_to_overwrite_a_result_without_overwrite(rope_run):
  args = dict(lengths=[32], protocol="nonoverlapping", max_tokens=64)
  first, path = _evaluate(rope_run, **args)
  path.write_text(path.read_text().replace('"step": 7', '"step": 3'))
  before = path.read_bytes()
  exists = r"ppl_vs_length_len32_nonoverlapping_tok64.json exists \(step 3\).*--overwrite"
  with pytest.raises(FileExistsError, match=exists):
    _evaluate(rope_run, **args)
  assert path.read_bytes() == before
  again, path_again = _evaluate(rope_run, overwrite=True, **args)
  assert path_again == path and json.loads(path.read_text())["step"] == 7
  assert again["records"] == first["records"]


def test_evaluate_workdir_resolves_a_relative_workdir(rope_run, monkeypatch):
  monkeypatch.chdir(rope_run.parent)
  _, path = _evaluate(rope_run.name, lengths=[32], protocol="sliding", stride=16, max_tokens=64)
  assert path == rope_run / "eval" / "ppl_vs_length_len32_sliding_stride16_tok64.json"
  assert path.exists()


@pytest.mark.parametrize(
  "args, expected",
  [
    (["--workdir=DIR", "--rope_factor=4"], "--rope_factor=4 needs --rope_scaling"),
    (["--workdir=DIR", "--compare=DIR", "--plot=x.png"], "--workdir is not read by --compare"),
    (["--compare=DIR", "--plot=x.png", "--lengths=64"], "--lengths is not read by --compare"),
    (["--workdir=DIR", "--plot=x.png"], "--plot needs --compare"),
    (
      ["--workdir=DIR", "--effective_fraction=0.8", "--effective_threshold=10"],
      "--effective_threshold replaces --effective_fraction",
    ),
    (["--workdir=DIR", "--effective_threshold=0.5"], "largest perplexity"),
    (["--workdir=DIR", "--key_short_window=8"], "--key_short_window=8 needs --key_tokens"),
    (["--workdir=DIR", "--task_lengths=4", "--key_tokens"], "--key_tokens applies to perplexity"),
    (["--workdir=DIR", "--task_lengths=4", "--bca"], "--bca applies to perplexity"),
    (["--workdir=DIR", "--task_lengths=4", "--lengths=64"], "--lengths applies to perplexity"),
    (["--workdir=DIR", "--protocol=nonoverlapping", "--stride=8"], "--stride"),
    (["--workdir="], "--workdir is empty"),
    (
      ["--workdir=DIR", "--lengths=32", "--protocol=nonoverlapping", "--max_tokens=128"],
      "--overwrite",
    ),
  ],
)
def test_eval_cli_bad_flag_combinations_exit_with_one_line(rope_run, args, expected, monkeypatch):
  _evaluate(rope_run, lengths=[32], protocol="nonoverlapping", overwrite=True)
  # What main sets for a process of its own (CPU flags, the compilation cache) stays unset here.
  monkeypatch.setattr(cpu_flags, "set_default_cpu_flags", lambda: False)
  monkeypatch.setattr(compile_cache, "enable_from_flags", lambda *args: None)
  error = _main_error(*(a.replace("DIR", str(rope_run)) for a in args))
  assert error.startswith("eval.py: error: ") and "\n" not in error and expected in error, error


def test_a_bad_flag_combination_is_one_line_on_stderr_and_no_traceback(rope_run):
  """The exit the in-process cases above raise, as a user's shell sees it."""
  proc = _run_cli(f"--workdir={rope_run}", "--rope_factor=4")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if "error" in line]
  assert errors == ["eval.py: error: --rope_factor=4 needs --rope_scaling=KIND"], proc.stderr


def _main_error(*args) -> str:
  """The message eval.py's main exits with for `args` (flag errors: absl's own message), parsed
  and run in this process."""
  cli = testing.load_script("eval.py")
  cli.FLAGS.unparse_flags()
  try:
    cli.FLAGS(["eval.py", *args])
  except flags.Error as e:
    return f"eval.py: error: {e}"
  try:
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["eval.py"])
  finally:
    cli.FLAGS.unparse_flags()
  return str(exit_info.value.code)


def test_plot_says_log_scale_and_which_windows_the_position_panel_shows(tmp_path, monkeypatch):
  from roformer.evals import plots

  figures = []
  monkeypatch.setattr(plots.plt, "close", figures.append)
  records = [
    {"length": n, "protocol": "nonoverlapping", "loss": float(np.log(p)), "ppl": p, "tokens": 8}
    for n, p in ((32, 5.0), (64, 80.0))
  ]  # a blow-up: the perplexity axis goes logarithmic
  per_position = {"length": 64, "protocol": "nonoverlapping", "loss": [1.0, 2.0]}
  result = {"posenc": "rope", "records": records, "per_position": per_position}
  plots.plot_runs([("rope", result, 32)], tmp_path / "p.png")
  ax_len, ax_pos = figures[0].axes[:2]
  assert ax_len.get_yscale() == "log" and "log scale" in ax_len.get_ylabel()
  assert "log2 scale" in ax_len.get_xlabel()
  assert "nonoverlapping windows" in ax_pos.get_title()


@pytest.mark.parametrize(
  "script, patched, args",
  [
    ("eval", "roformer.evals.ppl_vs_length:evaluate_workdir", ["--workdir=DIR"]),
    ("generate", "roformer.generate:generate_text", ["--workdir=DIR", "--prompt=x"]),
  ],
)
def test_ctrl_c_is_one_line_and_exit_130(script, patched, args):
  module, function = patched.split(":")
  code = (
    "import sys\n"
    "from absl import app\n"
    f"sys.argv = ['{script}.py', *{args!r}]\n"
    f"import {script} as cli\n"
    f"import {module} as patched\n"
    "def interrupted(*args, **kwargs):\n"
    "  raise KeyboardInterrupt\n"
    f"patched.{function} = interrupted\n"
    "app.run(cli.main)\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert proc.returncode == 130
  assert proc.stderr.strip().splitlines() == [
    f"{script}.py: interrupted"
    + ("; no result written (DIR/eval/ is as before)" if script == "eval" else "")
  ]


def test_max_tokens_that_is_no_multiple_of_the_longest_length_is_rounded_with_a_line(rope_run):
  lines = []
  result, _ = _evaluate(rope_run, max_tokens=100, out="rounded", overwrite=True, log=lines.append)
  assert any("--max_tokens=100 is scored as 64 targets" in line for line in lines)
  assert {r["tokens"] for r in result["records"]} == {64} and result["max_tokens"] == 100
