"""eval.py's results away from the workdir (--out_dir), refused before any work when they cannot
be written, and its one-line errors that name the flag at fault."""

import json

import pytest

from roformer import runs, testing
from roformer.evals import plots, ppl_vs_length, spec
from roformer.infra import compile_cache, cpu_flags
from tests.e2e.eval_cli_test import SEQ_LEN, _main_error, _make_run

HF_DIR = testing.FIXTURES / "hf_llama_tiny"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return _make_run(tmp_path_factory.mktemp("runs"), "run")


@pytest.fixture
def cli(monkeypatch):
  """eval.py's main in this process: what main sets for a process of its own (CPU flags, the
  compilation cache) stays unset."""
  monkeypatch.setattr(cpu_flags, "set_default_cpu_flags", lambda: False)
  monkeypatch.setattr(compile_cache, "enable_from_flags", lambda *args: None)
  return _main_error


def _no_model(monkeypatch):
  """Loading a model fails the test: the error must come first."""

  def loaded(*args, **kwargs):
    raise AssertionError("a model was loaded")

  monkeypatch.setattr(runs, "restore_for_eval", loaded)
  monkeypatch.setattr(runs, "open_hf_model", loaded)


def test_out_dir_takes_the_results_and_compare_reads_them(run, tmp_path):
  options = spec.spec_from_options(lengths=[32], protocol="nonoverlapping", max_tokens=64)
  out = tmp_path / "results"
  result, path = ppl_vs_length.evaluate_workdir(run, options, out_dir=str(out), log=lambda _: None)
  assert path == out / "ppl_vs_length_len32_nonoverlapping_tok64.json"
  assert path.with_suffix(".png").exists() and not (run / "eval").exists()
  assert json.loads(path.read_text())["workdir"] == str(run) == result["workdir"]
  # --compare reads an --out_dir directory, and the training length from the recorded run.
  ((folder, read),) = plots.read_results([str(out)], path.stem, hint="")
  assert folder == out and read == result
  assert plots.training_length(plots.run_of(folder, read)) == SEQ_LEN


@pytest.mark.parametrize(
  "args, expected",
  [
    (
      ["--workdir=RUN", "--out_dir=FILE/sub"],
      "eval.py: error: --out_dir=FILE/sub: cannot write the results there (FILE is not a "
      "directory)",
    ),
    (
      ["--workdir=RUN", "--task_lengths=4", "--out_dir=FILE/sub"],
      "eval.py: error: --out_dir=FILE/sub: cannot write the results there (FILE is not a "
      "directory)",
    ),
    (
      [f"--hf_model={HF_DIR}", "--out_dir=FILE/sub"],
      "eval.py: error: --out_dir=FILE/sub: cannot write the results there (FILE is not a "
      "directory)",
    ),
    (
      [f"--hf_model={HF_DIR}"],
      "eval.py: error: --hf_model needs --out_dir=DIR for its results (nothing is written into "
      "the model's directory)",
    ),
    (
      [f"--hf_model={HF_DIR}", "--workdir=RUN"],
      "eval.py: error: --workdir names a training run; --hf_model evaluates HF_DIR instead: give "
      "--out_dir=DIR for its results",
    ),
    (
      ["--workdir=RUN", "--lengths="],
      "eval.py: error: --lengths is empty: give lengths (--lengths=256,512), or leave it out for "
      "the defaults",
    ),
    (
      ["--workdir=RUN", "--task_lengths="],
      "eval.py: error: --task_lengths is empty: give lengths (--task_lengths=256,512), or leave "
      "it out for the defaults",
    ),
    (["--workdir=RUN", "--max_tokens=0"], "eval.py: error: --max_tokens must be >= 1, got 0"),
    (
      ["--workdir=RUN", "--extend=self_extend", "--extend_window=8"],
      "eval.py: error: --extend=self_extend needs --extend_group >= 1",
    ),
    (["--workdir=RUN/missing"], "eval.py: error: the workdir RUN/missing does not exist"),
  ],
)
def test_a_mistake_is_one_line_before_any_model_is_loaded(
  run, tmp_path, cli, monkeypatch, args, expected
):
  _no_model(monkeypatch)
  (tmp_path / "file").write_text("not a directory")
  paths = {"RUN": str(run), "FILE": str(tmp_path / "file")}
  replace = lambda text: text.replace("RUN", paths["RUN"]).replace("FILE", paths["FILE"])  # noqa: E731
  assert cli(*map(replace, args)) == replace(expected)


def test_a_read_only_workdir_is_refused_before_any_model_is_loaded(run, cli, monkeypatch):
  import os

  _no_model(monkeypatch)
  access = os.access
  # A read-only workdir (root may write anywhere, so the permission is what is simulated).
  monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and str(run) not in str(p))
  assert cli(f"--workdir={run}") == (
    f"eval.py: error: cannot write the results to {run}/eval ({run} is not writable); give "
    "--out_dir=DIR to write them elsewhere"
  )


def test_data_files_errors_name_the_flag(run, tmp_path, cli):
  (tmp_path / "texts").mkdir()
  (tmp_path / "texts" / "a.txt").write_text("def f(x):\n  return x\n" * 40)
  folder = str(tmp_path / "texts")
  assert cli(f"--workdir={run}", f"--data_files={folder}", "--lengths=32") == (
    f"eval.py: error: --data_files={folder}: {folder} is a directory; give a glob of its files, "
    f"e.g. {folder}/*.txt (or {folder}/**/*.txt with subdirectories)"
  )
  latin1 = tmp_path / "latin1.txt"
  latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
  assert cli(f"--workdir={run}", f"--data_files={latin1}", "--lengths=32") == (
    f"eval.py: error: --data_files={latin1}: {latin1} is not utf-8 text (byte 0xe9 at offset "
    "3); convert the file to utf-8 (eval.py reads --data_files as the run's "
    "data.text_encoding='utf-8')"
  )


def test_compare_keeps_a_path_with_a_comma_and_names_the_results_there(tmp_path):
  for name in ("a,b", "c"):
    (tmp_path / name / "eval").mkdir(parents=True)
  (tmp_path / "a,b" / "eval" / "ppl_vs_length.json").write_text("{}")
  a_b, c = str(tmp_path / "a,b"), str(tmp_path / "c")
  assert plots.split_sources([f"{a_b},{c}", c]) == [a_b, c, c]
  with pytest.raises(FileNotFoundError, match=f"^--compare={a_b},x: x does not exist$"):
    plots.split_sources([f"{a_b},x"])
  with pytest.raises(ValueError, match="--compare is empty"):
    plots.split_sources([""])
  # A run evaluated at other lengths: the error names what is there.
  (tmp_path / "c" / "eval" / "ppl_vs_length_len256.json").write_text("{}")
  with pytest.raises(FileNotFoundError) as raised:
    plots.read_results([c], "ppl_vs_length", hint="")
  assert str(raised.value) == (
    f"{c}/eval/ppl_vs_length.json does not exist; {c} has the results ppl_vs_length_len256: "
    "pass --out=NAME to draw one of them"
  )
