"""Training: optimizer, the jitted train step, and the loop (evaluation, checkpoints, metrics).

Entry point: `train_and_evaluate(config, workdir)` (train.py is a thin CLI over it). The loop's
periodic actions (log, evaluate, save, stop) live in roformer/train/loop.py.
"""

import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer import data as data_lib
from roformer.config import ConfigError, RunConfig
from roformer.infra import checkpoint, metrics_log, preemption, prefetch, sharding
from roformer.infra import workdir as workdir_lib
from roformer.nn import model as model_lib
from roformer.posenc import POSENCS, PosEnc
from roformer.posenc import randomized as randomized_positions
from roformer.train import init_from
from roformer.train import loop as train_loop
from roformer.train.loop import Setup
from roformer.train.optimizer import decay_mask as decay_mask
from roformer.train.optimizer import make_optimizer, make_schedule

# ---- Step functions ----


def loss_sums(
  model,
  batch: dict,
  *,
  deterministic: bool,
  rngs: nnx.Rngs | None,
  max_predictions: int = 0,
) -> dict:
  """Weighted sums of the cross-entropy and of correct predictions over one batch.

  With `max_predictions` (encoders), the output layer runs only at the first `max_predictions`
  positions of nonzero weight in each row, gathered as BERT's pre-training does: the masked
  positions, about 15% of the [B, L, V] matmul. A batch with a row of more weighted positions
  takes the all-positions path instead (lax.cond), so the sums never depend on the capacity.
  A prediction counts as correct when the target's logit is the row maximum.

  Args:
    model: Encoder or Decoder.
    batch: "inputs", "targets", "positions" int32 [B, L], optionally "segment_ids" int32 [B, L]
      (absent = one document per row); "weights" float32 [B, L] (decoder: 1 on real next-token
      targets; encoder: 1 on masked positions).
    max_predictions: per-row capacity of scored positions; 0 = score every position.

  Returns:
    {"loss_sum", "correct_sum", "weight_sum"} float32 scalars (divided once, on host).
  """
  h_BLD = model.hidden(
    batch["inputs"],
    batch["positions"],
    segment_ids_BL=batch.get("segment_ids"),
    deterministic=deterministic,
    rngs=rngs,
  )
  targets_BL = batch["targets"]
  weights_BL = batch["weights"].astype(jnp.float32)
  L = targets_BL.shape[1]

  def head_sums(h_BCD, targets_BC, weights_BC):
    logits_BCV = model.logits(h_BCD).astype(jnp.float32)
    target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    nll_BC = jax.nn.logsumexp(logits_BCV, axis=-1) - target_logit_BC
    # A max reduction instead of an argmax, which XLA:CPU runs on one thread.
    correct_BC = (target_logit_BC >= logits_BCV.max(axis=-1)).astype(jnp.float32)
    return jnp.sum(nll_BC * weights_BC), jnp.sum(correct_BC * weights_BC)

  if 0 < max_predictions < L:
    count_B = jnp.sum(weights_BL != 0, axis=1)

    def gathered(h_BLD, targets_BL, weights_BL):
      C = max_predictions
      index_BC = jax.vmap(lambda w_L: jnp.nonzero(w_L != 0, size=C, fill_value=0)[0])(weights_BL)
      h_BCD = jnp.take_along_axis(h_BLD, index_BC[..., None], axis=1)
      t_BC, w_BC = (jnp.take_along_axis(x, index_BC, axis=1) for x in (targets_BL, weights_BL))
      # Slots past a row's count repeat position 0: weight 0.
      return head_sums(h_BCD, t_BC, jnp.where(jnp.arange(C)[None, :] < count_B[:, None], w_BC, 0.0))

    loss_sum, correct_sum = jax.lax.cond(
      jnp.all(count_B <= max_predictions), gathered, head_sums, h_BLD, targets_BL, weights_BL
    )
  else:
    loss_sum, correct_sum = head_sums(h_BLD, targets_BL, weights_BL)
  return {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": jnp.sum(weights_BL)}


def train_step_options(run_config: RunConfig) -> dict:
  """The static keyword arguments of `train_step` for a run (train.py and benchmarks share them)."""
  optim, train, data = run_config.optim, run_config.train, run_config.data
  encoder = run_config.model.kind == "encoder"
  return dict(
    schedule=make_schedule(optim, train.num_train_steps),
    seed=train.seed,
    grad_accum_steps=optim.grad_accum_steps,
    randomize_max=run_config.model.posenc.randomize_max,
    packed=data.pack,
    max_predictions=data_lib.max_predictions(data.seq_len, data.mlm_probability) if encoder else 0,
  )


def train_step(
  model_state,
  opt_state,
  batch: dict,
  step,
  *,
  model_def,
  opt_def,
  schedule: optax.Schedule,
  seed: int,
  grad_accum_steps: int,
  randomize_max: int = 0,
  packed: bool = True,
  max_predictions: int = 0,
):
  """One optimizer step on a global batch; returns (model_state, opt_state, metrics).

  Without `packed`, every row is one document and the segment ids are dropped (no segment mask
  in attention); `max_predictions` is `loss_sums`'.

  The loss is the sum of weighted token losses divided by the batch's total weight, so gradient
  accumulation over microbatches gives the same update as one big batch. Dropout keys are
  fold_in(key(seed), step) (then the microbatch index): a resumed run draws the same masks.
  With `randomize_max` (posenc.randomize_max), each document's positions are replaced by a sorted
  random subset of [0, randomize_max) of its own length, drawn from (seed, step)
  (`randomized_positions`).
  """
  if randomize_max:
    positions_BL = randomized_positions.randomize_positions(
      batch["positions"],
      batch.get("segment_ids"),
      max_position=randomize_max,
      key=randomized_positions.train_key(seed, step),
    )
    batch = dict(batch, positions=positions_BL)
  model = nnx.merge(model_def, model_state)
  optimizer = nnx.merge(opt_def, opt_state)
  step_key = jax.random.fold_in(jax.random.key(seed), step)
  total_weight = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)

  def loss_fn(model, micro, key):
    if not packed:
      micro = {k: v for k, v in micro.items() if k != "segment_ids"}
    sums = loss_sums(
      model,
      micro,
      deterministic=False,
      rngs=nnx.Rngs(dropout=key),
      max_predictions=max_predictions,
    )
    return sums["loss_sum"] / total_weight, sums

  grad_fn = nnx.grad(loss_fn, has_aux=True)
  if grad_accum_steps == 1:
    grads, sums = grad_fn(model, batch, step_key)
  else:
    # Microbatch m takes rows m, m + A, m + 2A, ...: every device keeps its own rows of each.
    def split(x):
      x = x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:])
      return jnp.moveaxis(x, 1, 0)

    micro_batches = {k: split(v) for k, v in batch.items()}
    params = nnx.state(model, nnx.Param)
    zeros = (
      jax.tree.map(jnp.zeros_like, params),
      {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "correct_sum", "weight_sum")},
    )

    graphdef, state = nnx.split(model)

    def body(carry, xs):
      index, micro = xs
      # Fresh Variables inside the scan's trace (nnx refuses ones from the outer trace).
      inner = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
      grads, sums = grad_fn(inner, micro, jax.random.fold_in(step_key, index))
      return jax.tree.map(jnp.add, carry, (grads, sums)), None

    (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum_steps), micro_batches))
  grad_norm = optax.tree.norm(grads)
  optimizer.update(model, grads)
  # Encodings whose parameters live in a constrained set (KERPLE's r >= 0.01) project them back.
  for _, module in nnx.iter_modules(model):
    if isinstance(module, PosEnc):
      module.constrain()
  # A finite loss and gradient can still overflow the update into inf parameters.
  params_finite = jnp.all(
    jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
  )
  metrics = dict(
    sums, grad_norm=grad_norm, params_finite=params_finite, learning_rate=schedule(step)
  )
  return nnx.state(model), nnx.state(optimizer), metrics


# ---- Setup ----


def _check_or_replace_config(run_config: RunConfig, workdir: epath.Path) -> None:
  """The resume rule: a rerun keeps DIR/config.json, unless no checkpoint was ever written.

  A run that died before its first checkpoint left nothing to resume, so a corrected config may
  replace it; the earlier attempt's files move to DIR/replaced/ so no record of it mixes in.
  """
  previous = config_lib.read_config_json(workdir)
  if previous is None:
    return
  if checkpoint.finished_steps(workdir):
    config_lib.check_resume(previous, run_config)
    return
  changed = config_lib.changed_fields(
    config_lib.with_defaults(previous), config_lib.to_dict(run_config)
  )
  if not changed or jax.process_index() != 0:
    return
  moved_to = workdir_lib.archive_run_files(str(workdir))
  logging.warning(
    "%s holds no checkpoint: this config replaces the one of the earlier attempt (changed: %s); "
    "its files moved to %s.",
    workdir,
    ", ".join(changed),
    moved_to,
  )


def _warn_about_schedule(run_config: RunConfig) -> None:
  optim, train = run_config.optim, run_config.train
  if train.num_train_steps < optim.warmup_steps:
    logging.warning(
      "train.num_train_steps=%d is shorter than optim.warmup_steps=%d: the learning rate never "
      "reaches its peak optim.learning_rate=%g.",
      train.num_train_steps,
      optim.warmup_steps,
      optim.learning_rate,
    )


def _setup(run_config: RunConfig, workdir: epath.Path) -> Setup:
  """Everything that can fail on bad input, before any compiling or checkpoint is touched."""
  _check_or_replace_config(run_config, workdir)
  if jax.process_count() > 1:
    _sync("config checked")  # process 0 may have moved an earlier attempt's files
  _warn_about_schedule(run_config)
  corpus = data_lib.load_corpus(run_config.data, workdir=str(workdir))
  model_cfg = dataclasses.replace(run_config.model, vocab_size=corpus.tokenizer.vocab_size)
  run_config = dataclasses.replace(run_config, model=model_cfg)
  model_lib.validate_model(run_config.model, seq_len=run_config.data.seq_len)
  mesh = sharding.make_mesh(run_config.mesh)
  rules = sharding.axis_rules(run_config.mesh)
  train, optim = run_config.train, run_config.optim
  ways = sharding.batch_axis_size(mesh, rules)
  micro = train.global_batch_size // optim.grad_accum_steps
  if micro % ways:
    raise ConfigError(
      f"train.global_batch_size / optim.grad_accum_steps = {micro} must be divisible by the "
      f"{ways} ways the batch is split over the mesh ({dict(mesh.shape)})"
    )
  batch_index, batch_count = sharding.process_batch_slice(mesh, rules, train.global_batch_size)
  batches = corpus.train_batches(
    run_config.data,
    model_kind=run_config.model.kind,
    global_batch_size=train.global_batch_size,
    seed=train.seed,
    process_index=batch_index,
    process_count=batch_count,
  )
  if train.init_from and not epath.Path(train.init_from).exists():
    raise ConfigError(f"train.init_from={train.init_from}: no such directory")
  return Setup(run_config, corpus, mesh, rules, batches)


def _make_model_fn(run_config: RunConfig):
  def make():  # a fresh Rngs inside the trace of eval_shape / jit
    return model_lib.make_model(run_config.model, rngs=nnx.Rngs(run_config.train.seed))

  return make


def create_train_state(run_config: RunConfig, tx: optax.GradientTransformation, mesh, rules):
  """A freshly initialised model and optimizer, born sharded over `mesh`.

  Returns:
    (model_def, model_state, opt_def, opt_state): nnx graphdefs and states of the model and of
    its nnx.Optimizer (AdamW moments sharded like the parameters).
  """
  make = _make_model_fn(run_config)
  model_def, model_state = nnx.split(sharding.create_sharded(make, mesh, rules))
  optimizer = sharding.create_sharded(
    lambda state: nnx.Optimizer(nnx.merge(model_def, state), tx, wrt=nnx.Param),
    mesh,
    rules,
    model_state,
  )
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


def _abstract(state: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _count_params(model_state) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model_state, nnx.Param)))


def _log_startup(setup: Setup, num_params: int, workdir: epath.Path) -> None:
  logging.info(
    "JAX %s: process %d of %d, %d local / %d global devices: %s",
    jax.__version__,
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
    jax.devices(),
  )
  logging.info("Mesh %s, rules %s", dict(setup.mesh.shape), setup.rules)
  logging.info("Parameters: %s", f"{num_params:,}")
  logging.info("Workdir %s; resolved config:\n%s", workdir, config_lib.describe(setup.run_config))


# ---- The loop ----


def _setup_or_config_error(run_config: RunConfig, workdir: epath.Path) -> Setup:
  try:
    return _setup(run_config, workdir)
  except ConfigError:
    raise
  except ValueError as e:  # data.DataError, the model's checks: already one clear message
    raise ConfigError(str(e)) from e


def _sync(name: str) -> None:
  from jax.experimental import multihost_utils

  multihost_utils.sync_global_devices(name)


def _resolve_paths(run_config: RunConfig) -> RunConfig:
  """train.init_from as an absolute path (config.json must not depend on the current directory)."""
  train = run_config.train
  if not train.init_from:
    return run_config
  init_from = workdir_lib.resolve(train.init_from, flag="train.init_from")
  return dataclasses.replace(run_config, train=dataclasses.replace(train, init_from=init_from))


def _lock(workdir: epath.Path, stack: contextlib.ExitStack) -> None:
  """Creates the workdir and locks it (process 0); every process stops if the lock is refused."""
  workdir_lib.make_writable(str(workdir))
  error = None
  if jax.process_index() == 0:
    try:
      stack.enter_context(workdir_lib.WorkdirLock(str(workdir)))
    except workdir_lib.WorkdirError as e:
      error = e
  if jax.process_count() > 1 and preemption.any_process(error is not None) and error is None:
    raise workdir_lib.WorkdirError(f"--workdir={workdir}: process 0 could not lock it")
  if error is not None:
    raise error


def _set_aside(manager, workdir: epath.Path, steps: list[int], resumed: int) -> None:
  """Moves unreadable checkpoints out of the way (process 0), then every manager rescans."""
  if jax.process_count() > 1:
    _sync("unreadable checkpoints found")  # every process has tried them before any moves
  if jax.process_index() == 0:
    for step in steps:
      moved = checkpoint.set_aside(workdir, step)
      logging.warning(
        "The checkpoint of step %d is unreadable: moved to %s; resuming from step %d.",
        step,
        moved,
        resumed,
      )
  if jax.process_count() > 1:
    _sync("unreadable checkpoints moved")
  manager.reload()


def _restore_or_init(
  setup: Setup, tx: optax.GradientTransformation, manager, workdir: epath.Path
) -> tuple:
  """The train state: the latest checkpoint's, else fresh (or train.init_from's parameters).

  Returns:
    (model_def, model_state, opt_def, opt_state, start_step).
  """
  rc, mesh, rules = setup.run_config, setup.mesh, setup.rules
  if manager.latest_step() is not None:
    model_def, model_abs, opt_def, opt_abs = abstract_train_state(rc, tx, mesh, rules)
    model_state, opt_state, meta, step, unreadable = checkpoint.restore_latest_readable(
      manager, model_abs, opt_abs
    )
    if unreadable:
      _set_aside(manager, workdir, unreadable, step)
    logging.info("Resumed from the checkpoint of step %d (%s).", step, meta)
    return model_def, model_state, opt_def, opt_state, step
  model_def, model_state, opt_def, opt_state = create_train_state(rc, tx, mesh, rules)
  if rc.train.init_from:
    model_state = init_from.load_init_state(rc.train.init_from, _abstract(model_state), rc.model)
  return model_def, model_state, opt_def, opt_state, 0


def _jit_train_step(loop: train_loop.Loop) -> Any:
  """train_step jitted with the state's shardings, donating the state."""
  rc, mesh, rules = loop.config, loop.setup.mesh, loop.setup.rules
  model_sh = sharding.shardings_of(loop.model_state)
  opt_sh = sharding.shardings_of(loop.opt_state)
  repl = sharding.replicated(mesh)
  return jax.jit(
    functools.partial(
      train_step, model_def=loop.model_def, opt_def=loop.opt_def, **train_step_options(rc)
    ),
    in_shardings=(model_sh, opt_sh, sharding.batch_sharding(mesh, rules), repl),
    out_shardings=(model_sh, opt_sh, repl),
    donate_argnums=(0, 1),
  )


def _compile(loop: train_loop.Loop, step_fn: Any, batch: dict, step_array: jax.Array) -> Any:
  start = time.perf_counter()
  compiled = step_fn.lower(loop.model_state, loop.opt_state, batch, step_array).compile()
  logging.info(
    "Compiled the train step in %.1fs; training from step %d to %d.",
    time.perf_counter() - start,
    loop.start_step,
    loop.config.train.num_train_steps,
  )
  return compiled


def _start(run_config: RunConfig, workdir: epath.Path) -> train_loop.Loop:
  """Checks the config against the workdir, writes config.json, restores or creates the state."""
  setup = _setup_or_config_error(run_config, workdir)
  rc = setup.run_config
  train = rc.train
  is_main = jax.process_index() == 0
  if is_main:
    config_lib.write_config_json(workdir, rc)
  tx = make_optimizer(
    rc.optim,
    train.num_train_steps,
    decay_posenc=POSENCS[rc.model.posenc.kind].decays_parameters,
  )
  manager = checkpoint.make_manager(workdir, keep=train.keep_checkpoints)
  try:
    model_def, model_state, opt_def, opt_state, start_step = _restore_or_init(
      setup, tx, manager, workdir
    )
  except BaseException:
    manager.close()
    raise
  if is_main:
    _log_startup(setup, _count_params(model_state), workdir)
  if start_step >= train.num_train_steps:
    logging.info("Nothing to train: the checkpoint is at step %d.", start_step)
  return train_loop.Loop(
    setup=setup,
    workdir=workdir,
    manager=manager,
    writer=metrics_log.MetricsWriter(workdir, enabled=is_main),
    console=metrics_log.ConsoleLog(
      train.num_train_steps, log_every_steps=train.log_every_steps, enabled=is_main
    ),
    model_def=model_def,
    opt_def=opt_def,
    model_state=model_state,
    opt_state=opt_state,
    start_step=start_step,
  )


def train_and_evaluate(config: Any, workdir: str) -> dict:
  """Trains (or resumes) the run in `workdir` and evaluates it periodically on validation data.

  A local workdir is locked for the whole run (DIR/.lock): a second run into it stops before
  reading or writing anything there. SIGTERM and SIGINT save a checkpoint and return.

  Args:
    config: a ConfigDict of configs/default.py's layout (or the same as a nested dict).
    workdir: the run directory (local path, relative or with ~, or gs://...).

  Returns:
    The last evaluation's metrics ({} without evaluation).

  Raises:
    ConfigError: bad input (config value, data, mesh), raised before compiling or touching a
      checkpoint; the message names the field.
    WorkdirError: the workdir is empty, cannot be written, or another run holds it.
    CheckpointNotFoundError: no checkpoint in the workdir reads back.
    NonFiniteLossError: the loss or gradient became NaN or infinite.
  """
  workdir = epath.Path(workdir_lib.resolve(str(workdir)))
  run_config = _resolve_paths(config_lib.run_config_from_dict(config))
  with contextlib.ExitStack() as stack:
    _lock(workdir, stack)  # before anything in the workdir is read or written
    loop = _start(run_config, workdir)
    stack.callback(train_loop.close, loop)
    _train(loop)
  return loop.last_eval


def _train(loop: train_loop.Loop) -> None:
  """Steps from loop.start_step to train.num_train_steps, or until a signal asks to stop."""
  setup, train = loop.setup, loop.config.train
  step_fn, compiled, pending = _jit_train_step(loop), None, None

  def load(step: int):  # runs on the prefetch thread, ahead of the step that uses it
    local = setup.batches.batch(step)
    return sharding.put_batch(local, setup.mesh, setup.rules, train.global_batch_size)

  steps = range(loop.start_step, train.num_train_steps)
  with preemption.PreemptionWatcher() as watcher, prefetch.Prefetcher(load, steps) as prefetched:
    for step, batch in prefetched:
      step_array = jnp.asarray(step, jnp.int32)
      if compiled is None:
        compiled = _compile(loop, step_fn, batch, step_array)
        loop.console.start(loop.start_step)
      loop.model_state, loop.opt_state, metrics = compiled(
        loop.model_state, loop.opt_state, batch, step_array
      )
      done = step + 1
      # Pull the previous step's metrics after dispatching this one: the host never idles.
      if pending is not None:
        train_loop.finish_step(loop, *pending)
      pending = (done, metrics)
      stop = preemption.stop_requested(watcher, train, done)
      due = train_loop.due(train, done, stop)
      if due.any:
        train_loop.finish_step(loop, *pending)
        pending = None
      if due.log:
        train_loop.log_train(loop, done)
      if due.save:
        train_loop.save(loop, done)
      if stop:
        loop.manager.wait_until_finished()
        logging.warning(
          "%s received: saved the checkpoint of step %d; exiting.",
          watcher.signal_name or "A stop request from another process",
          done,
        )
        return
      if due.eval:
        train_loop.evaluate(loop, done)
    if pending is not None:
      train_loop.finish_step(loop, *pending)
