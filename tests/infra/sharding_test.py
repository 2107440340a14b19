"""Tests of the mesh, the logical-axis rules, batch placement, and sharded training."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from roformer import testing
from roformer.config import ConfigError, MeshConfig
from roformer.infra import sharding

RULES = MeshConfig().rules


@pytest.mark.parametrize(
  "sizes, devices, expected",
  [
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 2)),
    ((1, 1, -1), 4, (1, 1, 4)),
    ((2, 2, 2), 8, (2, 2, 2)),
  ],
)
def test_mesh_shape_fills_the_remaining_devices(sizes, devices, expected):
  mesh_cfg = MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2])
  assert sharding.mesh_shape(mesh_cfg, devices) == expected


@pytest.mark.parametrize("sizes", [(2, 2, 1), (-1, 3, 1)])
def test_mesh_shape_mismatch_raises_naming_mesh_fields(sizes):
  mesh_cfg = MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2])
  with pytest.raises(ConfigError, match=r"mesh\."):
    sharding.mesh_shape(mesh_cfg, 8)


def test_make_mesh_has_auto_axes_in_order():
  mesh = sharding.make_mesh(MeshConfig())
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert mesh.devices.size == jax.device_count()


def test_logical_spec_follows_rules_and_uses_each_mesh_axis_once():
  assert sharding.logical_spec(("batch", None), RULES) == P(("data", "fsdp"), None)
  assert sharding.logical_spec(("embed", "heads", "kv"), RULES) == P("fsdp", "tensor", None)
  # 'mlp' and 'vocab' both map to 'tensor': the second one stays unsharded.
  assert sharding.logical_spec(("mlp", "vocab"), RULES) == P("tensor", None)
  assert sharding.logical_spec(("unknown",), RULES) == P(None)


def test_fit_spec_leaves_uneven_dimensions_unsharded():
  devices = np.array(jax.devices() * 4)[:4].reshape(1, 2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
  assert sharding.fit_spec(P("tensor", "fsdp"), (259, 32), mesh) == P(None, "fsdp")
  assert sharding.fit_spec(P("tensor", "fsdp"), (258, 32), mesh) == P("tensor", "fsdp")


def test_single_process_feeds_the_whole_batch():
  mesh = sharding.make_mesh(MeshConfig())
  assert sharding.process_batch_slice(mesh, RULES, 8) == (0, 1)
  batch = {"inputs": np.arange(16, dtype=np.int32).reshape(8, 2)}
  placed = sharding.put_batch(batch, mesh, RULES, 8)
  np.testing.assert_array_equal(np.asarray(placed["inputs"]), batch["inputs"])


_SHARDED_RUN = """
import json, sys
from flax import nnx
from roformer import config as config_lib
from roformer import testing
from roformer.infra import sharding
from roformer.train import loop as train_loop
from roformer.train import optimizer, state

overrides, workdir = json.loads(sys.argv[1]), sys.argv[2]
config = testing.tiny_config(overrides)
run_config = config_lib.run_config_from_dict(config)
mesh = sharding.make_mesh(run_config.mesh)
tx = optimizer.make_optimizer(run_config.optim, run_config.train.num_train_steps)
_, model_state, _, opt_state = state.create_train_state(run_config, tx, mesh, run_config.mesh.rules)
specs = {
  "/".join(map(str, path)): str(v.get_value().sharding.spec)
  for state in (model_state, opt_state)
  for path, v in nnx.to_flat_state(state)
}
train_loop.train_and_evaluate(config, workdir)
print("SPECS " + json.dumps(specs))
"""


# Per-layer encodings with chunked windows, QK-norm's learned scales, SSMax's per-head s and
# the per-head sink logits.
_FRONTIER = {
  "posenc.layer_pattern": "rope,nope", "model.attention_window_pattern": "8,0",
  "model.attention_window_kind": "chunked", "model.qk_norm": "rmsnorm",
  "posenc.query_scale": "ssmax", "model.attention_sinks": True,
}  # fmt: skip
# FoX's forget gate (which refuses sinks, so a run of its own).
_FOX = {"model.forget_gate": True, "posenc.kind": "nope"}


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, _FRONTIER, _FOX], ids=["default", "frontier", "fox"])
def test_sharded_training_matches_one_device(tmp_path, options):
  overrides = {"train.num_train_steps": 20, "train.checkpoint_every_steps": 0, **options}
  single = testing.run_train(tmp_path / "single", overrides, devices=1)
  assert single.returncode == 0, single.stderr[-3000:]
  sharded_overrides = {**overrides, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
  sharded = subprocess.run(
    [sys.executable, "-c", _SHARDED_RUN, json.dumps(sharded_overrides), str(tmp_path / "sharded")],
    env=testing.subprocess_env(devices=8),
    cwd=testing.REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert sharded.returncode == 0, sharded.stderr[-3000:]
  specs = json.loads(sharded.stdout.split("SPECS ", 1)[1])
  # Parameters and their Adam moments are split over fsdp and tensor, not replicated.
  kernel = "layers/0/mlp/up/kernel"
  assert specs[kernel] == "P('fsdp', 'tensor')"
  assert specs[f"opt_state/1/0/mu/{kernel}"] == specs[kernel]
  assert specs["layers/0/attn/query/kernel"] == "P('fsdp', 'tensor', None)"
  assert specs["embed/embedding"] == "P(None, 'fsdp')"  # 261 rows: uneven over tensor
  if options == _FRONTIER:  # one s and sink per head, split with the heads; QK-norm scales span
    assert specs["layers/0/attn/query_scale/s"] == "P('tensor',)"  # 'kv', replicated
    assert specs["layers/0/attn/sinks"] == "P('tensor',)"
    assert specs["layers/0/attn/query_norm/scale"] == "P(None,)"
  if options == _FOX:  # the gate's [D, H] kernel as the query kernel's first two axes
    assert specs["layers/0/attn/forget_gate/proj/kernel"] == "P('fsdp', 'tensor')"
    assert specs["layers/0/attn/forget_gate/proj/bias"] == "P('tensor',)"

  single_train, single_eval = testing.read_metrics(tmp_path / "single")
  sharded_train, sharded_eval = testing.read_metrics(tmp_path / "sharded")
  assert sorted(single_train) == sorted(sharded_train) == list(range(1, 21))
  for step in range(1, 21):
    testing.assert_close(
      sharded_train[step]["train_loss"], single_train[step]["train_loss"], 1e-4, f"step {step}"
    )
  testing.assert_close(sharded_eval[20]["eval_loss"], single_eval[20]["eval_loss"], 1e-4, "eval")
