"""The train state: a model and its optimizer, created sharded, or restored from the latest readable
checkpoint (unreadable ones set aside), or started from train.init_from's parameters."""

from typing import Any

import jax
import numpy as np
import optax
from absl import logging
from etils import epath
from flax import nnx

from roformer.config import RunConfig
from roformer.infra import checkpoint, preemption, sharding
from roformer.nn import model as model_lib
from roformer.train import init_from


def _make_model_fn(run_config: RunConfig):
  def make():  # a fresh Rngs inside the trace of eval_shape / jit
    return model_lib.make_model(run_config.model, rngs=nnx.Rngs(run_config.train.seed))

  return make


def create_train_state(run_config: RunConfig, tx: optax.GradientTransformation, mesh, rules):
  """A freshly initialised model and optimizer, born sharded over `mesh`.

  Both come from one jitted program (one trace, one compilation): the optimizer's state is
  zeros shaped by the parameters, which need not be a program of its own.

  Returns:
    (model_def, model_state, opt_def, opt_state): nnx graphdefs and states of the model and of
    its nnx.Optimizer (AdamW moments sharded like the parameters).
  """
  make = _make_model_fn(run_config)

  def make_both():
    model = make()
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  model, optimizer = sharding.create_sharded(make_both, mesh, rules)
  model_def, model_state = nnx.split(model)
  opt_def, opt_state = nnx.split(optimizer)
  return model_def, model_state, opt_def, opt_state


def abstract_train_state(run_config: RunConfig, tx: optax.GradientTransformation, mesh, rules):
  """As create_train_state, with sharded jax.ShapeDtypeStruct leaves (restore targets)."""
  make = _make_model_fn(run_config)
  model_def, model_abs = sharding.abstract_state(make, mesh, rules)
  opt_def, opt_abs = sharding.abstract_state(
    lambda: nnx.Optimizer(make(), tx, wrt=nnx.Param), mesh, rules
  )
  return model_def, model_abs, opt_def, opt_abs


def abstract_like(state: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def count_params(model_state) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model_state, nnx.Param)))


def _set_aside(manager, workdir: epath.Path, unreadable: list, resumed: int) -> None:
  """Moves unreadable checkpoints ((step, why) pairs) out of the way (process 0), then every
  manager rescans."""
  if jax.process_count() > 1:
    # Every process has tried them before any moves.
    preemption.sync_processes("unreadable checkpoints found")
  if jax.process_index() == 0:
    for step, why in unreadable:
      moved = checkpoint.set_aside(workdir, step)
      logging.warning(
        "The checkpoint of step %d is unreadable (%s): moved to %s; resuming from step %d.",
        step,
        why,
        moved,
        resumed,
      )
  if jax.process_count() > 1:
    preemption.sync_processes("unreadable checkpoints moved")
  manager.reload()


def restore_or_init(
  run_config: RunConfig, mesh, rules, tx: optax.GradientTransformation, manager, workdir: epath.Path
) -> tuple:
  """The train state: the latest checkpoint's, else fresh (or train.init_from's parameters).

  Returns:
    (model_def, model_state, opt_def, opt_state, start_step).
  """
  if manager.latest_step() is not None:
    model_def, model_abs, opt_def, opt_abs = abstract_train_state(run_config, tx, mesh, rules)
    model_state, opt_state, meta, step, unreadable = checkpoint.restore_latest_readable(
      manager, model_abs, opt_abs
    )
    if unreadable:
      _set_aside(manager, workdir, unreadable, step)
    logging.info("Resumed from the checkpoint of step %d (%s).", step, meta)
    return model_def, model_state, opt_def, opt_state, step
  model_def, model_state, opt_def, opt_state = create_train_state(run_config, tx, mesh, rules)
  if run_config.train.init_from:
    model_state = init_from.load_init_state(
      run_config.train.init_from, abstract_like(model_state), run_config.model
    )
  return model_def, model_state, opt_def, opt_state, 0
