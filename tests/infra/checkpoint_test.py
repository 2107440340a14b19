"""Tests of checkpoint saving, restoring (sharded targets), restore_model and init_from paths."""

import dataclasses
import errno
import logging
import os
import signal

import jax
import numpy as np
import pytest
from etils import epath
from flax import nnx

from configs import default
from roformer import config as config_lib
from roformer import runs, testing
from roformer.errors import StorageFullError
from roformer.infra import checkpoint, preemption, sharding
from roformer.train import init_from, optimizer
from roformer.train import state as state_lib


def _tiny_run_config():
  config = default.get_config()
  config.model.num_layers = 1
  config.model.emb_dim = 16
  config.model.num_heads = 2
  config.model.mlp_dim = 32
  config.model.attention_impl = "dense"
  config.data.seq_len = 16
  return config_lib.run_config_from_dict(config)


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _save_run(workdir, run_config, model_state, opt_state, *, step):
  """A finished run in `workdir`: its config.json and one checkpoint at `step`."""
  config_lib.write_config_json(workdir, run_config)
  manager = checkpoint.make_manager(workdir)
  checkpoint.save(manager, step, model_state, opt_state, {"step": step})
  manager.wait_until_finished()
  manager.close()


@pytest.fixture(scope="module")
def train_state():
  run_config = _tiny_run_config()
  mesh = sharding.make_mesh(run_config.mesh)
  tx = optimizer.make_optimizer(run_config.optim, 10)
  state = state_lib.create_train_state(run_config, tx, mesh, run_config.mesh.rules)
  return run_config, mesh, tx, state


def test_checkpoint_round_trip_restores_every_array_with_its_sharding(tmp_path, train_state):
  run_config, mesh, tx, (model_def, model_state, opt_def, opt_state) = train_state
  # Make the optimizer state non-trivial so a restore of zeros would be caught.
  opt_state = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, opt_state)
  manager = checkpoint.make_manager(tmp_path, keep=2)
  checkpoint.save(manager, 7, model_state, opt_state, {"step": 7, "data": {"next_batch": 7}})
  manager.wait_until_finished()
  assert manager.latest_step() == 7
  _, model_abs, _, opt_abs = state_lib.abstract_train_state(
    run_config, tx, mesh, run_config.mesh.rules
  )
  model_back, opt_back, meta = checkpoint.restore(manager, 7, model_abs, opt_abs)
  manager.close()
  assert meta == {"step": 7, "data": {"next_batch": 7}}
  for a, b in zip(
    _leaves(model_state) + _leaves(opt_state), _leaves(model_back) + _leaves(opt_back), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(model_state), jax.tree.leaves(model_back), strict=True):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_manager_keeps_only_the_latest_checkpoints(tmp_path, train_state):
  _, _, _, (_, model_state, _, opt_state) = train_state
  manager = checkpoint.make_manager(tmp_path, keep=2)
  for step in (1, 2, 3):
    checkpoint.save(manager, step, model_state, opt_state, {"step": step})
  manager.wait_until_finished()
  assert manager.all_steps() == [2, 3]
  manager.close()


def test_restore_model_returns_the_saved_parameters(tmp_path, train_state):
  run_config, _, _, (model_def, model_state, _, opt_state) = train_state
  _save_run(tmp_path, run_config, model_state, opt_state, step=3)
  model, step = runs.restore_model(tmp_path)
  assert step == 3
  for a, b in zip(_leaves(model_state), _leaves(nnx.state(model)), strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(checkpoint.CheckpointNotFoundError, match="no checkpoint of step 5"):
    runs.restore_model(tmp_path, step=5)


def test_restore_model_without_checkpoint_names_the_directory(tmp_path):
  config_lib.write_config_json(tmp_path, _tiny_run_config())
  with pytest.raises(checkpoint.CheckpointNotFoundError, match="no checkpoint in .*checkpoints"):
    runs.restore_model(tmp_path)


def test_init_from_rejects_a_directory_that_is_no_run(tmp_path, train_state):
  _, _, _, (_, model_state, _, _) = train_state
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), model_state
  )
  with pytest.raises(config_lib.ConfigError, match="train.init_from"):
    init_from.load_init_state(str(tmp_path), abstract)
  with pytest.raises(config_lib.ConfigError, match="no such directory"):
    init_from.load_init_state(str(tmp_path / "missing"), abstract)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_preemption_watcher_turns_sigterm_and_sigint_into_a_flag(signum):
  previous = signal.getsignal(signum)
  with preemption.PreemptionWatcher() as watcher:
    assert not watcher.requested()
    os.kill(os.getpid(), signum)
    assert watcher.requested() and watcher.signal_name == signum.name
  assert signal.getsignal(signum) is previous


def test_preemption_watcher_second_sigint_interrupts_at_once():
  with preemption.PreemptionWatcher() as watcher:
    os.kill(os.getpid(), signal.SIGINT)
    assert watcher.requested()
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)


def test_restore_latest_readable_skips_a_truncated_checkpoint(tmp_path, train_state):
  run_config, mesh, tx, (_, model_state, _, opt_state) = train_state
  manager = checkpoint.make_manager(tmp_path)
  for step in (2, 4):
    checkpoint.save(manager, step, model_state, opt_state, {"step": step})
  manager.wait_until_finished()
  data_files = [p for p in (tmp_path / "checkpoints" / "4" / "model").rglob("d/*") if p.is_file()]
  biggest = max(data_files, key=lambda p: p.stat().st_size)
  size = biggest.stat().st_size
  biggest.write_bytes(biggest.read_bytes()[:50])
  _, model_abs, _, opt_abs = state_lib.abstract_train_state(
    run_config, tx, mesh, run_config.mesh.rules
  )
  restored, _, meta, step, unreadable = checkpoint.restore_latest_readable(
    manager, model_abs, opt_abs
  )
  assert (step, meta) == (2, {"step": 2})
  ((bad_step, why),) = unreadable
  assert bad_step == 4 and why.endswith(f"holds 50 bytes, {size} when saved"), why
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(model_state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = checkpoint.set_aside(tmp_path, 4)
  assert moved == tmp_path / checkpoint.UNREADABLE_DIR / "4" and moved.is_dir()
  manager.reload()
  assert manager.all_steps() == [2]
  manager.close()


def test_restore_latest_readable_without_a_readable_checkpoint_raises_one_line(
  tmp_path, train_state
):
  run_config, mesh, tx, (_, model_state, _, opt_state) = train_state
  manager = checkpoint.make_manager(tmp_path)
  checkpoint.save(manager, 3, model_state, opt_state, {"step": 3})
  manager.wait_until_finished()
  for path in (tmp_path / "checkpoints" / "3" / "optimizer").rglob("d/*"):
    path.write_bytes(b"")
  _, model_abs, _, opt_abs = state_lib.abstract_train_state(
    run_config, tx, mesh, run_config.mesh.rules
  )
  with pytest.raises(checkpoint.CheckpointNotFoundError) as error:
    checkpoint.restore_latest_readable(manager, model_abs, opt_abs)
  manager.close()
  assert "\n" not in str(error.value) and "step 3:" in str(error.value)


def test_a_full_disk_while_saving_is_one_line_naming_the_last_complete_checkpoint(
  tmp_path, train_state, monkeypatch, caplog
):
  _, _, _, (_, model_state, _, opt_state) = train_state
  manager = checkpoint.make_manager(tmp_path)
  checkpoint.save(manager, 2, model_state, opt_state, {"step": 2})
  checkpoint.wait_until_saved(manager)
  path_type = type(epath.Path(tmp_path))
  write_text = path_type.write_text

  def full_disk(self, *args, **kwargs):  # where Orbax marks a step committed
    if self.name == "commit_success.txt":
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write_text(self, *args, **kwargs)

  monkeypatch.setattr(path_type, "write_text", full_disk)
  with caplog.at_level(logging.INFO):
    checkpoint.save(manager, 4, model_state, opt_state, {"step": 4})
    with pytest.raises(StorageFullError) as error:
      checkpoint.save(manager, 6, model_state, opt_state, {"step": 6})  # reports step 4's save
    checkpoint.close(manager)  # the failure was reported once
  message = str(error.value)
  assert "\n" not in message and "the checkpoint of step 4" in message, message
  assert "the disk is full" in message and "the last complete checkpoint is step 2" in message
  assert not [r for r in caplog.records if r.exc_info], "Orbax's tracebacks were logged"
  assert testing.checkpoint_steps(tmp_path) == [2]


@pytest.mark.parametrize("suffix", ["", "checkpoints", "checkpoints/4"])
def test_init_from_a_run_loads_its_parameters(tmp_path, train_state, suffix):
  run_config, _, _, (_, model_state, _, opt_state) = train_state
  _save_run(tmp_path, run_config, model_state, opt_state, step=4)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), model_state
  )
  state = init_from.load_init_state(str(tmp_path / suffix), abstract)
  for a, b in zip(_leaves(model_state), _leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)


def _scan_train_state():
  run_config = _tiny_run_config()
  model = dataclasses.replace(run_config.model, num_layers=2, scan_layers=True, remat="full")
  run_config = dataclasses.replace(run_config, model=model)
  mesh = sharding.make_mesh(run_config.mesh)
  tx = optimizer.make_optimizer(run_config.optim, 10)
  state = state_lib.create_train_state(run_config, tx, mesh, run_config.mesh.rules)
  return run_config, mesh, tx, state


def test_scan_layers_checkpoint_round_trip_keeps_stacked_parameters(tmp_path):
  run_config, mesh, tx, (_, model_state, _, opt_state) = _scan_train_state()
  stacked = nnx.state(model_state, nnx.Param)["layers"]["mlp"]["up"]["kernel"]
  assert stacked.shape == (2, 16, 32)
  manager = checkpoint.make_manager(tmp_path, keep=1)
  checkpoint.save(manager, 3, model_state, opt_state, {"step": 3})
  manager.wait_until_finished()
  _, model_abs, _, opt_abs = state_lib.abstract_train_state(
    run_config, tx, mesh, run_config.mesh.rules
  )
  model_back, opt_back, _ = checkpoint.restore(manager, 3, model_abs, opt_abs)
  manager.close()
  for a, b in zip(
    _leaves(model_state) + _leaves(opt_state), _leaves(model_back) + _leaves(opt_back), strict=True
  ):
    np.testing.assert_array_equal(a, b)


def test_init_from_hugging_face_into_scanned_layers_is_one_clear_error():
  run_config, mesh, tx, (_, model_state, _, _) = _scan_train_state()
  fixture = testing.FIXTURES / "hf_roformer_tiny"
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_state)
  with pytest.raises(config_lib.ConfigError, match="scan_layers=False"):
    init_from.load_init_state(str(fixture), abstract)


def test_init_from_a_run_of_another_shape_names_the_parameters_and_config_fields(
  tmp_path, train_state
):
  run_config, _, _, (_, model_state, _, opt_state) = train_state
  _save_run(tmp_path, run_config, model_state, opt_state, step=4)
  wider = dataclasses.replace(run_config.model, mlp_dim=48)
  mesh = sharding.make_mesh(run_config.mesh)
  other = dataclasses.replace(run_config, model=wider)
  _, abstract, _, _ = state_lib.abstract_train_state(
    other, optimizer.make_optimizer(run_config.optim, 10), mesh, run_config.mesh.rules
  )
  with pytest.raises(config_lib.ConfigError) as error:
    init_from.load_init_state(str(tmp_path), abstract, wider)
  message = str(error.value)
  assert "\n" not in message and "partial_restore" not in message
  assert "layers/0/mlp/up/kernel" in message and "(16, 32) there, (16, 48) here" in message
  assert "config fields model.mlp_dim: 32 -> 48" in message
