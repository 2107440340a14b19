"""train.py as a user runs it: workdir paths and lock, bad input, damaged or missing checkpoints.

Every case runs the real CLI in a subprocess on the tiny config of roformer.testing.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roformer import config as config_lib
from roformer import testing
from roformer.infra import compile_cache, cpu_flags

# A few steps, one checkpoint and one evaluation at the end.
SHORT = {
  "train.num_train_steps": 4,
  "train.checkpoint_every_steps": 0,
  "train.eval_every_steps": 0,
}


def _run(args, *, cwd, env=None, timeout=600):
  return subprocess.run(
    args,
    cwd=cwd,
    env=testing.subprocess_env(**(env or {})),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _train_args(workdir: str, overrides=None, config="configs/default.py"):
  settings = {**testing.TINY_TRAIN, **(overrides or {})}
  return [
    sys.executable,
    str(testing.REPO / "train.py"),
    f"--config={config}",
    f"--workdir={workdir}",
    *testing.flag_args(settings),
  ]


def _error_line(result) -> str:
  assert result.returncode != 0
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1, result.stderr[-3000:]
  return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("workdir", ["runs/relative", "~/run"])
def test_relative_and_home_workdirs_train_save_and_evaluate(tmp_path, workdir):
  env = {"HOME": str(tmp_path / "home")}
  config = str(testing.REPO / "configs" / "default.py")
  trained = _run(_train_args(workdir, SHORT, config=config), cwd=tmp_path, env=env)
  assert trained.returncode == 0, trained.stderr[-3000:]
  resolved = tmp_path / ("home/run" if workdir.startswith("~") else workdir)
  assert testing.checkpoint_steps(resolved) == [4]
  assert config_lib.load_run_config(resolved).train.num_train_steps == 4
  evaluated = _run(
    [
      sys.executable,
      str(testing.REPO / "eval.py"),
      f"--workdir={workdir}",
      "--lengths=32",
      "--protocol=nonoverlapping",
      "--max_tokens=64",
    ],
    cwd=tmp_path,
    env=env,
  )
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  result = json.loads(
    (resolved / "eval" / "ppl_vs_length_len32_nonoverlapping_tok64.json").read_text()
  )
  assert result["step"] == 4


def _undecodable(tmp_path: Path, ext: str) -> dict:
  folder = tmp_path / "latin1"
  folder.mkdir()
  text = "caf\u00e9 au lait\n" * 50
  if ext == ".jsonl":
    text = json.dumps({"text": text}, ensure_ascii=False) + "\n"
  (folder / f"good{ext}").write_text(text.replace("\u00e9", "e"), encoding="utf-8")
  (folder / f"bad{ext}").write_bytes(text.encode("latin-1"))
  return {"data.files": str(folder / f"*{ext}")}


_BAD_INPUTS = {
  "empty_workdir": ({}, {"workdir": ""}, "--workdir is empty"),
  "mistyped_config_path": ({}, {"config": "configs/defualt.py"}, "no such file; configs/ has"),
  "misspelt_group": ({"modle.num_layers": 3}, {}, "modle is not a config group"),
  "unwritable_workdir": ({}, {"workdir": "FILE/run"}, "cannot create it"),
  "config_syntax_error": ({}, {"config": "BROKEN"}, "invalid syntax (line 1, column 16)"),
  "float_for_an_integer": (
    {"train.num_train_steps": "1e3"},
    {},
    "train.num_train_steps takes an integer",
  ),
  "word_for_a_bool": ({"data.pack": "yes"}, {}, "data.pack takes a bool (true or false)"),
  "infinite_learning_rate": (
    {"optim.learning_rate": "inf"},
    {},
    "optim.learning_rate must be a finite number, got inf",
  ),
  "field_of_another_source": ({"data.source": "pystdlib"}, {}, "data.source='pystdlib'"),
  "latin1_txt": ("latin1.txt", {}, "bad.txt is not utf-8 text (byte 0xe9 at offset 3)"),
  "latin1_jsonl": ("latin1.jsonl", {}, "bad.jsonl is not utf-8 text (byte 0xe9 at offset 13)"),
}


def _bad_input_args(tmp_path, case) -> list[str]:
  """train.py's arguments for `case` of _BAD_INPUTS (its files made in tmp_path)."""
  overrides, args, _ = _BAD_INPUTS[case]
  if isinstance(overrides, str):
    overrides = _undecodable(tmp_path, "." + overrides.split(".")[1])
  (tmp_path / "FILE").write_text("")
  (tmp_path / "broken.py").write_text("def get_config(:\n  pass\n")
  workdir = args.get("workdir", str(tmp_path / "run")).replace("FILE", str(tmp_path / "FILE"))
  config = args.get("config", "configs/default.py").replace("BROKEN", str(tmp_path / "broken.py"))
  return _train_args(workdir, overrides, config=config)[2:]


def _main_error(args, capsys, monkeypatch) -> str:
  """The lines train.py prints on stderr when it exits for `args`, parsed and run in this
  process (as `app.run` would: its flag parser, then main)."""
  cli = testing.load_script("train.py")
  # What main sets for a process of its own (CPU flags, the compilation cache) stays unset here.
  monkeypatch.setattr(cpu_flags, "set_default_cpu_flags", lambda: False)
  monkeypatch.setattr(compile_cache, "enable_from_flags", lambda *args: None)
  monkeypatch.chdir(testing.REPO)
  monkeypatch.setattr(sys, "argv", ["train.py", *args])  # where the config flag finds overrides
  cli.FLAGS.unparse_flags()
  try:
    with pytest.raises(SystemExit) as exit_info:
      cli.main(cli._parse_flags(["train.py", *args]))
  finally:
    cli.FLAGS.unparse_flags()
  assert exit_info.value.code == 1
  return capsys.readouterr().err


@pytest.mark.parametrize("case", sorted(_BAD_INPUTS))
def test_bad_input_exits_with_one_line_and_writes_nothing(tmp_path, case, capsys, monkeypatch):
  stderr = _main_error(_bad_input_args(tmp_path, case), capsys, monkeypatch)
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train.py: error: "), stderr
  expected = _BAD_INPUTS[case][2]
  assert expected in lines[0], lines[0]
  if case == "field_of_another_source":
    assert "data.files" in lines[0]
  if case.startswith("latin1"):
    assert "data.text_encoding" in lines[0]
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_bad_input_is_one_line_on_stderr_and_no_traceback(tmp_path):
  """The exit the in-process cases above raise, as a user's shell sees it."""
  case = "misspelt_group"
  result = _run([sys.executable, str(testing.REPO / "train.py"), *_bad_input_args(tmp_path, case)],
                cwd=testing.REPO)  # fmt: skip
  assert result.returncode == 1
  assert _BAD_INPUTS[case][2] in _error_line(result)
  assert "Compiled the train step" not in result.stderr


def _wait_for(predicate, process, log_path, what, timeout=600):
  deadline = time.time() + timeout
  while not predicate():
    assert process.poll() is None, log_path.read_text()[-3000:]
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


@pytest.mark.slow
def test_second_run_is_refused_while_the_first_runs_and_after_sigkill_the_next_resumes(tmp_path):
  workdir = tmp_path / "run"
  endless = {
    "train.num_train_steps": 100_000,
    "train.checkpoint_every_steps": 5,
    "train.eval_every_steps": 0,
  }
  log_path = tmp_path / "first.log"
  first = testing.start_train(workdir, endless, log_path=log_path)
  try:
    _wait_for(lambda: testing.checkpoint_steps(workdir), first, log_path, "a checkpoint")
    names = sorted(p.name for p in workdir.iterdir())
    config_mtime = (workdir / "config.json").stat().st_mtime_ns
    holder = (workdir / ".lock").read_text()

    second = testing.run_train(workdir, endless)
    line = _error_line(second)
    assert "in use by another training run" in line and f"pid {first.pid} on host" in line
    assert "Compiled the train step" not in second.stderr
    # The second run touched nothing: no new file, config.json and the lock record unchanged.
    assert first.poll() is None
    assert sorted(p.name for p in workdir.iterdir()) == names
    assert (workdir / "config.json").stat().st_mtime_ns == config_mtime
    assert (workdir / ".lock").read_text() == holder
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()

  saved = max(testing.checkpoint_steps(workdir))
  resumed = testing.run_train(workdir, {**endless, "train.num_train_steps": saved + 2})
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Resumed from the checkpoint of step {saved}" in resumed.stderr
  assert saved + 2 in testing.checkpoint_steps(workdir)


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back_to_the_previous_and_resumes_exactly(tmp_path):
  workdir = tmp_path / "run"
  first = testing.run_train(workdir)
  assert first.returncode == 0, first.stderr[-3000:]
  assert testing.checkpoint_steps(workdir) == [20, 40]
  losses, _ = testing.read_metrics(workdir)
  data_files = [p for p in (workdir / "checkpoints" / "40").rglob("d/*") if p.is_file()]
  biggest = max(data_files, key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])

  rerun = testing.run_train(workdir)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "Traceback" not in rerun.stderr
  warnings = [
    line for line in rerun.stderr.splitlines() if "step 40" in line and "unreadable" in line
  ]
  assert warnings, rerun.stderr[-3000:]
  assert "Resumed from the checkpoint of step 20" in rerun.stderr
  assert (workdir / "unreadable_checkpoints" / "40").is_dir()
  assert testing.checkpoint_steps(workdir) == [20, 40]
  relosses, _ = testing.read_metrics(workdir)
  for step in range(21, 41):
    testing.assert_close(
      relosses[step]["train_loss"], losses[step]["train_loss"], 1e-6, f"step {step}"
    )


@pytest.mark.slow
def test_a_run_without_checkpoint_may_be_rerun_with_another_config(tmp_path):
  workdir = tmp_path / "run"
  # What a run that died before its first checkpoint leaves: its config and some metrics.
  died = config_lib.run_config_from_dict(testing.tiny_config({"optim.learning_rate": 1.0}))
  config_lib.write_config_json(workdir, died)
  (workdir / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 99.0}) + "\n")

  rerun = testing.run_train(workdir, SHORT)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  notes = [line for line in rerun.stderr.splitlines() if "holds no checkpoint" in line]
  assert len(notes) == 1 and "optim.learning_rate" in notes[0], rerun.stderr[-3000:]
  assert config_lib.load_run_config(workdir).optim.learning_rate == 3e-3
  train, _ = testing.read_metrics(workdir)
  assert sorted(train) == [1, 2, 3, 4] and train[1]["train_loss"] != 99.0
  (replaced,) = (workdir / "replaced").iterdir()
  assert "99.0" in (replaced / "metrics.jsonl").read_text()
  assert config_lib.load_run_config(replaced).optim.learning_rate == 1.0

  # With a checkpoint, the resume rule holds again.
  changed = testing.run_train(workdir, {**SHORT, "optim.learning_rate": 1e-2})
  assert "optim.learning_rate" in _error_line(changed)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
  """Three steps, fewer than optim.warmup_steps=5, with the regular log only at the end."""
  workdir = tmp_path_factory.mktemp("short") / "run"
  overrides = {**SHORT, "train.num_train_steps": 3, "train.log_every_steps": 1000}
  result = testing.run_train(workdir, overrides)
  assert result.returncode == 0, result.stderr[-3000:]
  yield result.stderr
  shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.slow
def test_a_run_shorter_than_warmup_warns_naming_both_fields(short_run):
  warnings = [line for line in short_run.splitlines() if "optim.warmup_steps=5" in line]
  assert len(warnings) == 1 and "train.num_train_steps=3" in warnings[0]


@pytest.mark.slow
def test_first_steps_are_logged_with_time_left_before_the_first_regular_line(short_run):
  lines = [line for line in short_run.splitlines() if "metrics_log" in line]
  assert any("step 1/3, train_loss" in line and "left" in line for line in lines), lines
  assert any("step 2/3, train_loss" in line and "left" in line for line in lines), lines


@pytest.mark.slow
def test_start_up_logs_a_config_summary_and_where_the_full_config_is(short_run):
  lines = short_run.splitlines()
  (summary,) = [line for line in lines if "] Config: " in line]
  assert "decoder, " in summary and " parameters; encoding " in summary, summary
  assert summary.endswith("config.json") and "all fields in " in summary, summary
  # Everything before the first step fits a screen (the resolved config alone is ~190 lines).
  first_step = next(i for i, line in enumerate(lines) if "step 1/3, train_loss" in line)
  assert first_step < 30, "\n".join(lines[:first_step])
