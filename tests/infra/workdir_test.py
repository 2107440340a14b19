"""Tests of the workdir boundary: path resolution, the run lock and replaced attempts."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from roformer.infra import workdir
from roformer.testing import REPO


def test_resolve_makes_relative_and_home_paths_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert workdir.resolve("runs/a") == str(tmp_path / "runs" / "a")
  assert workdir.resolve("~/run") == str(tmp_path / "home" / "run")
  assert workdir.resolve("gs://bucket/run") == "gs://bucket/run"


@pytest.mark.parametrize("path", ["", "  "])
def test_resolve_refuses_an_empty_workdir(path):
  with pytest.raises(workdir.WorkdirError, match="--workdir is empty"):
    workdir.resolve(path)


def test_make_writable_names_a_workdir_that_cannot_be_created(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(workdir.WorkdirError, match=r"--workdir=.*file/run: cannot create it"):
    workdir.make_writable(str(blocker / "run"))


def test_lock_refuses_a_second_holder_naming_pid_and_host(tmp_path):
  with workdir.WorkdirLock(str(tmp_path)):
    with pytest.raises(
      workdir.WorkdirError, match=rf"in use by another training run \(pid {os.getpid()} on host "
    ):
      workdir.WorkdirLock(str(tmp_path)).acquire()
  # Released on exit: the next run takes it.
  with workdir.WorkdirLock(str(tmp_path)):
    pass


def test_lock_of_a_killed_holder_is_free_without_cleanup(tmp_path):
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time; from roformer.infra import workdir;"
      " lock = workdir.WorkdirLock(sys.argv[1]); lock.acquire();"
      " print('locked', flush=True); time.sleep(600)",
      str(tmp_path),
    ],
    env=dict(os.environ, PYTHONPATH=str(REPO)),
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(workdir.WorkdirError, match=f"pid {holder.pid}"):
      workdir.WorkdirLock(str(tmp_path)).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  lock = workdir.WorkdirLock(str(tmp_path))
  lock.acquire()  # the kernel released the dead process's lock; the stale file is no obstacle
  assert f"pid {os.getpid()}" in (tmp_path / workdir.LOCK_FILE).read_text()
  lock.release()


def test_archive_run_files_moves_an_attempts_files_aside(tmp_path):
  for name in ("config.json", "metrics.jsonl", "tokenizer.json", "events.out.tfevents.1.host"):
    (tmp_path / name).write_text(name)
  (tmp_path / workdir.LOCK_FILE).write_text("pid 1")
  moved = Path(workdir.archive_run_files(str(tmp_path)))
  assert moved.parent == tmp_path / workdir.REPLACED_DIR
  assert sorted(p.name for p in moved.iterdir()) == [
    "config.json",
    "events.out.tfevents.1.host",
    "metrics.jsonl",
    "tokenizer.json",
  ]
  assert sorted(p.name for p in tmp_path.iterdir()) == [workdir.LOCK_FILE, workdir.REPLACED_DIR]
