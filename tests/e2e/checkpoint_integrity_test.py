"""A damaged latest checkpoint, as train.py, eval.py and generate.py meet it: each checks the
checkpoint's manifest, falls back to the previous checkpoint and says so in one line.

The entry points' drivers run in-process on copies of one tiny run (checkpoints at steps 2 and 4),
which is also the uninterrupted run a resume must reproduce.
"""

import logging
import shutil

import numpy as np
import pytest

from roformer import config as config_lib
from roformer import runs, testing
from roformer.errors import CheckpointNotFoundError
from roformer.evals import ppl_vs_length
from roformer.evals import spec as spec_lib
from roformer.generate import generate_text
from roformer.infra import manifest
from roformer.train import loop as train_loop

# One layer, no dropout, no periodic evaluation: the least there is to compile.
OVERRIDES = {
  "model.num_layers": 1,
  "model.dropout_rate": 0.0,
  "train.num_train_steps": 4,
  "train.checkpoint_every_steps": 2,
  "train.eval_max_tokens": 0,
}


def _config(overrides=None):
  return testing.tiny_config({**OVERRIDES, **(overrides or {})})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("integrity") / "run"
  train_loop.train_and_evaluate(_config(), str(workdir))
  assert testing.checkpoint_steps(workdir) == [2, 4]
  return workdir


def _copy(trained, tmp_path):
  return shutil.copytree(trained, tmp_path / "run")


def _damage(workdir, target: str, fill: str) -> str:
  """Overwrites bytes in the middle of a file of the step-4 checkpoint; returns its name there."""
  step_dir = workdir / "checkpoints" / "4"
  if target == "array":  # the biggest file of the model's array data
    path = max((p for p in (step_dir / "model").rglob("d/*") if p.is_file()), key=_size)
  else:  # the model's tree metadata
    path = step_dir / "model" / "_METADATA"
  data = bytearray(path.read_bytes())
  count = min(1000 if fill == "random" else 4000, len(data) // 2)
  start = (len(data) - count) // 2
  noise = np.random.default_rng(0).bytes(count) if fill == "random" else bytes(count)
  data[start : start + count] = noise
  path.write_bytes(bytes(data))
  return str(path.relative_to(step_dir))


def _size(path) -> int:
  return path.stat().st_size


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_saved_checkpoint_carries_the_digest_of_every_file(trained):
  step_dir = trained / "checkpoints" / "4"
  assert manifest.verify(step_dir)
  listed = manifest.MANIFEST_FILE in {p.name for p in step_dir.iterdir()}
  assert listed and any(p.match("model/*/d/*") for p in step_dir.rglob("*"))


@pytest.mark.parametrize("target", ["array", "metadata"])
@pytest.mark.parametrize("fill", ["random", "zeros"])
def test_a_reader_skips_a_damaged_checkpoint_in_one_line(trained, tmp_path, caplog, target, fill):
  workdir = _copy(trained, tmp_path)
  damaged = _damage(workdir, target, fill)
  with caplog.at_level(logging.WARNING):
    _, step = runs.restore_model(workdir)
  assert step == 2
  (line,) = _warnings(caplog)
  assert "\n" not in line and damaged in line and "using the checkpoint of step 2" in line
  assert testing.checkpoint_steps(workdir) == [2, 4]  # a reader moves nothing


def test_a_checkpoint_saved_without_a_manifest_loads_unchecked(trained, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  (workdir / "checkpoints" / "4" / manifest.MANIFEST_FILE).unlink()  # as older versions saved it
  with caplog.at_level(logging.WARNING):
    _, step = runs.restore_model(workdir)
  assert step == 4 and not _warnings(caplog)


def test_a_reader_asked_for_a_damaged_step_refuses_it_in_one_line(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  damaged = _damage(workdir, "array", "zeros")
  with pytest.raises(CheckpointNotFoundError) as refused:
    runs.restore_model(workdir, step=4)
  message = str(refused.value)
  assert "\n" not in message and "step 4" in message and damaged in message, message


def test_train_sets_a_damaged_checkpoint_aside_and_reproduces_the_losses(trained, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  damaged = _damage(workdir, "array", "random")
  with caplog.at_level(logging.WARNING):
    train_loop.train_and_evaluate(_config(), str(workdir))
  (line,) = [w for w in _warnings(caplog) if "unreadable" in w]
  assert "step 4" in line and damaged in line and "resuming from step 2" in line
  assert (workdir / "unreadable_checkpoints" / "4").is_dir()
  assert testing.checkpoint_steps(workdir) == [2, 4]
  resumed, _ = testing.read_metrics(workdir)
  uninterrupted, _ = testing.read_metrics(trained)
  assert [resumed[s]["train_loss"] for s in (3, 4)] == [
    uninterrupted[s]["train_loss"] for s in (3, 4)
  ]


def test_eval_evaluates_the_previous_checkpoint_of_a_damaged_one(trained, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  damaged = _damage(workdir, "array", "zeros")
  spec = spec_lib.spec_from_options(lengths=[32], protocol="nonoverlapping", max_tokens=64)
  with caplog.at_level(logging.WARNING):
    result, _ = ppl_vs_length.evaluate_workdir(workdir, spec, log=lambda line: None)
  assert result["step"] == 2
  (line,) = [w for w in _warnings(caplog) if "unreadable" in w.lower()]
  assert damaged in line and "using the checkpoint of step 2" in line


def test_generate_uses_the_previous_checkpoint_of_a_damaged_one(trained, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  damaged = _damage(workdir, "metadata", "random")
  with caplog.at_level(logging.WARNING):
    text = generate_text(workdir, "def ", max_new_tokens=2)
  (line,) = [w for w in _warnings(caplog) if "unreadable" in w.lower()]
  assert damaged in line and "using the checkpoint of step 2" in line
  (workdir / "checkpoints" / "4").rename(tmp_path / "step4")  # step 2 alone: the same text
  assert generate_text(workdir, "def ", max_new_tokens=2) == text


def test_a_workdir_with_checkpoints_but_no_config_json_is_refused_in_one_line(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  (workdir / "config.json").unlink()
  with pytest.raises(config_lib.ConfigError) as refused:
    train_loop.train_and_evaluate(_config({"posenc.kind": "alibi"}), str(workdir))
  message = str(refused.value)
  assert "\n" not in message and "no config.json" in message
  assert f"--config.train.init_from={workdir}" in message
  assert not (workdir / "config.json").exists()
