"""Tests of the training loop, end to end through train.py: resume, MLM training, bad input,
non-finite losses, signals, log windows, validation once per run."""

import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from roformer import config as config_lib
from roformer import runs, testing


def _no_traceback(result) -> None:
  assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
  straight = testing.run_train(tmp_path / "straight")
  assert straight.returncode == 0, straight.stderr[-3000:]

  workdir = tmp_path / "killed"
  process = testing.start_train(workdir, log_path=tmp_path / "killed.log")
  deadline = time.time() + 600
  while 20 not in testing.checkpoint_steps(workdir):
    assert process.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
    assert time.time() < deadline, "no step-20 checkpoint"
    time.sleep(0.02)
  # The step-20 evaluation (compiled on first use) keeps the run busy well past this point.
  assert process.poll() is None, "the run finished before it could be killed"
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert testing.checkpoint_steps(workdir) == [20]

  resumed = testing.run_train(workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from the checkpoint of step 20" in resumed.stderr
  straight_train, straight_eval = testing.read_metrics(tmp_path / "straight")
  resumed_train, resumed_eval = testing.read_metrics(workdir)
  assert sorted(resumed_train) == list(range(1, 41))
  for step in range(21, 41):
    testing.assert_close(
      resumed_train[step]["train_loss"], straight_train[step]["train_loss"], 1e-6, f"step {step}"
    )
  testing.assert_close(resumed_eval[40]["eval_loss"], straight_eval[40]["eval_loss"], 1e-6, "eval")

  # A rerun may not change anything but the step count and frequencies.
  changed = testing.run_train(workdir, {"optim.learning_rate": 1e-2, "train.num_train_steps": 50})
  assert changed.returncode != 0
  assert "optim.learning_rate" in changed.stderr and "train.num_train_steps" in changed.stderr
  _no_traceback(changed)
  assert testing.checkpoint_steps(workdir) == [20, 40]


@pytest.mark.slow
def test_mlm_config_logs_masked_loss_and_accuracy(tmp_path):
  overrides = {
    "data.vocab_size": 120,
    "model.embedding_size": 16,
    "train.num_train_steps": 30,
    "train.eval_every_steps": 30,
    "train.log_every_steps": 10,
    "train.checkpoint_every_steps": 0,
    "optim.learning_rate": 3e-3,
  }
  result = testing.run_train(tmp_path, overrides, config="configs/mlm.py")
  assert result.returncode == 0, result.stderr[-3000:]
  config = config_lib.load_run_config(tmp_path)
  assert config.model.kind == "encoder" and config.data.tokenizer == "wordpiece"
  assert (tmp_path / "tokenizer.json").exists()
  train, evals = testing.read_metrics(tmp_path)
  assert sorted(train) == [10, 20, 30]
  for record in train.values():
    assert 0.0 <= record["train_accuracy"] <= 1.0 and np.isfinite(record["train_loss"])
  assert train[30]["train_loss"] < train[10]["train_loss"]
  assert 0.0 <= evals[30]["eval_accuracy"] <= 1.0
  # Masked-token loss: near ln(vocab) at the start, far from the unmasked-token (copy) loss.
  assert evals[30]["eval_loss"] > 1.0
  assert list(Path(tmp_path).glob("events.out.tfevents.*"))


_BAD_INPUTS = [
  ({}, ["--config.model.num_layerz=3"], "model.num_layerz"),
  ({"posenc.kind": "rotary"}, [], "posenc.kind"),
  ({"data.files": "/nonexistent/*.txt"}, [], "data.files"),
  ({"data.files": "EMPTY"}, [], "empty"),
  (
    {
      "data.source": "hub",
      "data.hub_name": "someone/corpus",
      "data.files": "",
      "data.validation_files": "",
    },
    [],
    "data.hub_name",
  ),
  ({"posenc.kind": "learned", "posenc.max_len": 16}, [], "posenc.max_len"),
  ({"model.num_heads": 4, "model.num_kv_heads": 3}, [], "model.num_kv_heads"),
  ({"model.kind": "encoder", "posenc.kind": "xpos"}, [], "xpos"),
  ({"model.emb_dim": 30, "model.num_heads": 2}, [], "head_dim"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, args, expected", _BAD_INPUTS)
def test_bad_input_fails_with_one_clear_message(tmp_path, overrides, args, expected):
  if overrides.get("data.files") == "EMPTY":
    (tmp_path / "empty.txt").write_text("")
    overrides = {**overrides, "data.files": str(tmp_path / "empty.txt")}
  workdir = tmp_path / "run"
  result = testing.run_train(
    workdir, overrides, args=args, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
  )
  assert result.returncode != 0
  _no_traceback(result)
  errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
  assert not (workdir / "checkpoints").exists()
  assert "Compiled the train step" not in result.stderr


@pytest.mark.slow
def test_non_finite_loss_stops_naming_step_and_last_good_checkpoint(tmp_path):
  overrides = {
    "optim.learning_rate": 1e30,
    "optim.warmup_steps": 0,
    "optim.grad_clip_norm": 0.0,
    "train.checkpoint_every_steps": 1,
    "train.num_train_steps": 10,
  }
  result = testing.run_train(tmp_path, overrides)
  assert result.returncode == 1
  _no_traceback(result)
  message = next(line for line in result.stderr.splitlines() if "non-finite loss" in line)
  bad_step = int(message.split("non-finite loss at step ")[1].split()[0])
  good = testing.checkpoint_steps(tmp_path)
  assert good and max(good) == bad_step - 1
  assert f"The last good checkpoint is step {bad_step - 1}" in message
  model, step = runs.restore_model(tmp_path)
  assert step == bad_step - 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])  # a preemption, Ctrl-C
def test_signal_saves_a_checkpoint_and_exits_with_the_signals_status(tmp_path, signum):
  overrides = {
    "train.num_train_steps": 100_000,
    "train.checkpoint_every_steps": 0,
    "train.eval_every_steps": 0,
  }
  log_path = tmp_path / "run.log"
  process = testing.start_train(tmp_path / "run", overrides, log_path=log_path)
  deadline = time.time() + 600
  metrics = tmp_path / "run" / "metrics.jsonl"
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert process.poll() is None, log_path.read_text()[-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  process.send_signal(signum)
  # 128 + the signal's number, as a shell reports a process the signal ended: 130 / 143.
  assert process.wait(timeout=300) == 128 + signum, log_path.read_text()[-3000:]
  log = log_path.read_text()
  assert "Traceback" not in log
  assert f"{signum.name} received: saved the checkpoint of step" in log
  steps = testing.checkpoint_steps(tmp_path / "run")
  assert len(steps) == 1 and 3 <= steps[0] < 100_000
  assert f"saved the checkpoint of step {steps[0]}" in log
  train, _ = testing.read_metrics(tmp_path / "run")
  assert max(train) <= steps[0]


@pytest.mark.slow
def test_a_log_window_cut_short_by_a_resume_says_how_many_steps_it_covers(tmp_path):
  common = {"train.log_every_steps": 4, "train.eval_every_steps": 0, "train.eval_max_tokens": 0}
  first = testing.run_train(tmp_path, {**common, "train.num_train_steps": 6})
  assert first.returncode == 0, first.stderr[-3000:]
  resumed = testing.run_train(tmp_path, {**common, "train.num_train_steps": 12})
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  records, _ = testing.read_metrics(tmp_path)
  # Steps 5-6 end the first run, 7-8 begin the resumed one: two-step windows, said so; the
  # full windows (4 and 12) carry no count.
  assert {s: r.get("train_loss_steps") for s, r in records.items()} == {
    4: None,
    6: 2,
    8: 2,
    12: None,
  }
  assert "(train_loss over 2 steps)" in resumed.stderr


def test_a_run_validates_its_model_and_encoding_configs_once(tmp_path, monkeypatch):
  # A ModelConfig checks itself (and its posenc) when built; nothing after the config boundary
  # checks it again: not the setup, not make_model, not make_posenc, not the evaluation.
  from roformer.nn import config as nn_config
  from roformer.train import loop as train_loop

  calls = {"validate_model": 0, "validate_posenc": 0}

  def counted(name):
    real = getattr(nn_config, name)

    def count(*args, **kwargs):
      calls[name] += 1
      return real(*args, **kwargs)

    return count

  for name in calls:
    monkeypatch.setattr(nn_config, name, counted(name))
  overrides = {"train.num_train_steps": 2, "train.eval_every_steps": 2}
  train_loop.train_and_evaluate(testing.tiny_config(overrides), str(tmp_path / "run"))
  assert calls == {"validate_model": 1, "validate_posenc": 1}
