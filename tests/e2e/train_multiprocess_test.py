"""Multi-process training: two train.py processes on localhost (jax.distributed, gloo)."""

import subprocess

import pytest

from roformer import testing

STEPS = 10
OVERRIDES = {
  "train.num_train_steps": STEPS,
  "train.checkpoint_every_steps": 5,
  "train.eval_every_steps": 10,
  "mesh.data": 2,
  "mesh.fsdp": -1,
}


@pytest.mark.slow
def test_two_processes_log_the_same_losses_as_one_process(tmp_path):
  single = testing.run_train(tmp_path / "single", OVERRIDES, devices=4)
  assert single.returncode == 0, single.stderr[-3000:]

  port = testing.free_port()
  workdir = tmp_path / "multi"
  processes = [
    testing.start_train(
      workdir,
      OVERRIDES,
      devices=2,
      args=(
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ),
      log_path=tmp_path / f"process{i}.log",
    )
    for i in range(2)
  ]
  try:
    codes = [p.wait(timeout=600) for p in processes]
  except subprocess.TimeoutExpired:
    for p in processes:
      p.kill()
    raise
  logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  assert "process 0 of 2, 2 local / 4 global devices" in logs[0]
  # Only process 0 reports progress.
  assert f"step {STEPS}/{STEPS}" in logs[0] and f"step {STEPS}/{STEPS}" not in logs[1]

  single_train, single_eval = testing.read_metrics(tmp_path / "single")
  multi_train, multi_eval = testing.read_metrics(workdir)
  assert sorted(multi_train) == list(range(1, STEPS + 1))
  for step in range(1, STEPS + 1):
    testing.assert_close(
      multi_train[step]["train_loss"], single_train[step]["train_loss"], 1e-5, f"step {step}"
    )
  testing.assert_close(
    multi_eval[STEPS]["eval_loss"], single_eval[STEPS]["eval_loss"], 1e-5, "eval"
  )
  assert testing.checkpoint_steps(workdir) == [5, 10]
