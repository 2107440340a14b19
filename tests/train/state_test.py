"""Tests of roformer/train/state.py: the fresh train state from one program."""

import jax
import numpy as np
from flax import nnx

from roformer import config as config_lib
from roformer import testing
from roformer.infra import sharding
from roformer.train import optimizer
from roformer.train import state as state_lib


def _arrays(state) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def test_create_train_state_equals_the_model_initialised_alone_bitwise():
  # Model and optimizer come from one jitted program; the parameters must be exactly those of
  # the model's own initialiser (same seed) and the optimizer's state that of nnx.Optimizer.
  run_config = config_lib.run_config_from_dict(
    testing.tiny_config({"model.num_layers": 2, "model.activation": "swiglu"})
  )
  mesh = sharding.make_mesh(run_config.mesh)
  rules = run_config.mesh.rules
  tx = optimizer.make_optimizer(run_config.optim, run_config.train.num_train_steps)
  model_def, model_state, opt_def, opt_state = state_lib.create_train_state(
    run_config, tx, mesh, rules
  )
  make = state_lib._make_model_fn(run_config)
  alone = sharding.create_sharded(make, mesh, rules)
  want = _arrays(nnx.state(alone))
  got = _arrays(model_state)
  assert got.keys() == want.keys()
  for name, x in want.items():
    assert got[name].dtype == x.dtype and got[name].tobytes() == x.tobytes(), name
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    want_opt = _arrays(nnx.state(nnx.Optimizer(alone, tx, wrt=nnx.Param)))
  got_opt = _arrays(opt_state)
  assert got_opt.keys() == want_opt.keys()
  for name, x in want_opt.items():
    assert got_opt[name].tobytes() == x.tobytes(), name
  # The graphdefs rebuild the objects.
  assert isinstance(nnx.merge(opt_def, opt_state), nnx.Optimizer)
  assert type(nnx.merge(model_def, model_state)) is type(alone)
