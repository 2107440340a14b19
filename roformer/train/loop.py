"""The training loop: set a run up, then step, log, evaluate, save and stop.

Entry point: `train_and_evaluate(config, workdir)` (train.py is a thin CLI over it). Each periodic
action is one function of the shared `Loop` state, so the loop itself reads as one flat sequence
of steps; the step is roformer/train/step.py, the state roformer/train/state.py.
"""

import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from roformer import config as config_lib
from roformer import data as data_lib
from roformer.config import ConfigError, RunConfig
from roformer.data.synthetic import SyntheticBatches, SyntheticCorpus
from roformer.errors import NonFiniteLossError, RunInterrupted
from roformer.evals import perplexity
from roformer.infra import checkpoint, metrics_log, preemption, prefetch, sharding
from roformer.infra import workdir as workdir_lib
from roformer.posenc import POSENCS
from roformer.train import init_from
from roformer.train import state as train_state
from roformer.train import step as train_step_lib
from roformer.train.optimizer import make_optimizer


@dataclasses.dataclass
class Sums:
  """Train-step sums since the last log: the loss and the correct predictions over the target
  weight, and how many steps they cover (fewer than log_every_steps after a resume)."""

  loss: float = 0.0
  correct: float = 0.0
  weight: float = 0.0
  steps: int = 0

  def add(self, values: dict) -> None:
    self.loss += float(values["loss_sum"])
    self.correct += float(values["correct_sum"])
    self.weight += float(values["weight_sum"])
    self.steps += 1

  def mean(self, total: float) -> float:
    """`total` (the loss or correct sum) per unit of target weight."""
    return total / max(self.weight, 1.0)


@dataclasses.dataclass
class Setup:
  """The validated run: config, corpus, mesh and the batches of this process."""

  run_config: RunConfig
  corpus: data_lib.Corpus | SyntheticCorpus
  mesh: Mesh
  rules: tuple
  batches: data_lib.TrainBatches | SyntheticBatches  # the rows of this process


@dataclasses.dataclass
class Loop:
  """What the loop and its periodic actions share: the run, its live state and its writers."""

  setup: Setup
  workdir: epath.Path
  manager: ocp.CheckpointManager  # of DIR/checkpoints
  writer: metrics_log.MetricsWriter
  console: metrics_log.ConsoleLog
  model_def: nnx.GraphDef
  opt_def: nnx.GraphDef
  model_state: Any
  opt_state: Any
  start_step: int  # the step the run starts (or resumes) from
  validation: Any = None  # validation tokens, read on the first evaluation
  sums: Sums = dataclasses.field(default_factory=Sums)
  last_metrics: dict = dataclasses.field(default_factory=dict)  # the last finished step's values
  last_eval: dict = dataclasses.field(default_factory=dict)

  @property
  def run_config(self) -> RunConfig:
    return self.setup.run_config


@dataclasses.dataclass(frozen=True)
class Due:
  """The periodic actions due after a step."""

  log: bool
  save: bool
  eval: bool

  @property
  def any(self) -> bool:
    return self.log or self.save or self.eval


def due(train: config_lib.TrainConfig, done: int, stop: bool) -> Due:
  """Which actions run after `done` steps (`stop`: a signal asked the run to save and exit)."""
  last = done == train.num_train_steps
  every = lambda n: bool(n) and done % n == 0  # noqa: E731  (0 = only at the end)
  return Due(
    log=every(train.log_every_steps) or last,
    save=last or stop or every(train.checkpoint_every_steps),
    eval=train.eval_max_tokens > 0 and (last or every(train.eval_every_steps)),
  )


def evaluate(loop: Loop, step: int) -> None:
  """The periodic evaluation: perplexity at the training length, non-overlapping windows."""
  run_config, setup = loop.run_config, loop.setup
  if loop.validation is None:
    loop.validation = setup.corpus.tokens("validation")
  seq_len, is_encoder = run_config.data.seq_len, run_config.model.kind == "encoder"
  model = nnx.merge(loop.model_def, loop.model_state)
  start = time.perf_counter()
  with jax.set_mesh(setup.mesh):
    result = perplexity.evaluate_at_length(
      model,
      loop.validation,
      length=seq_len,
      protocol="nonoverlapping",
      stride=seq_len,
      max_tokens=run_config.train.eval_max_tokens,
      max_length=seq_len,
      batch_size=run_config.train.eval_batch_size or run_config.train.global_batch_size,
      tokenizer=setup.corpus.tokenizer,
      mlm_probability=run_config.data.mlm_probability,
      seed=run_config.train.seed,
      packed=run_config.data.pack,
      randomize_max=run_config.model.posenc.randomize_max,
      draws=1,  # one draw of randomized positions per periodic evaluation; eval.py takes more
    )
  scalars = {
    "eval_loss": result["loss"],
    "eval_ppl": result["ppl"],
    "eval_tokens": result["tokens"],
  }
  if is_encoder:
    scalars["eval_accuracy"] = result["accuracy"]
  loop.writer.write(step, scalars)
  logging.info(
    "step %d: eval_loss %.4f (ppl %.3f) on %d validation tokens in %.1fs%s",
    step,
    result["loss"],
    result["ppl"],
    result["tokens"],
    time.perf_counter() - start,
    f", eval_accuracy {result['accuracy']:.4f}" if is_encoder else "",
  )
  loop.last_eval = result
  loop.console.start(step)  # evaluation time is not training throughput


def save(loop: Loop, step: int) -> None:
  meta = {"step": step, "data": {"next_batch": step, "seed": loop.run_config.train.seed}}
  checkpoint.save(loop.manager, step, loop.model_state, loop.opt_state, meta)


def last_good(loop: Loop) -> str:
  checkpoint.wait_until_saved(loop.manager)
  good = loop.manager.latest_step()
  if good is None:
    return "No checkpoint was saved."
  where = checkpoint.checkpoint_dir(loop.workdir)
  return f"The last good checkpoint is step {good} in {where} (kept intact)."


def finish_step(loop: Loop, step: int, metrics: dict) -> None:
  """Pulls one step's metrics to host; stops the run on a non-finite loss or gradient."""
  values = jax.device_get(metrics)
  loss = values["loss_sum"] / max(values["weight_sum"], 1.0)
  if not (np.isfinite(loss) and np.isfinite(values["grad_norm"]) and values["params_finite"]):
    raise NonFiniteLossError(
      f"non-finite loss at step {step} (loss {loss}, grad_norm {values['grad_norm']}, "
      f"parameters finite: {bool(values['params_finite'])}); the run stopped. {last_good(loop)}"
    )
  loop.sums.add(values)
  loop.last_metrics = values
  if loop.console.wants_progress(step):
    loop.console.progress(step, {"train_loss": loop.sums.mean(loop.sums.loss)})


def log_train(loop: Loop, step: int) -> None:
  """Writes the train scalars averaged since the last log; restarts the average."""
  run_config = loop.run_config
  seconds_per_step = loop.console.rate(step)
  tokens_per_step = run_config.train.global_batch_size * run_config.data.seq_len
  sums = loop.sums
  scalars = {
    "train_loss": sums.mean(sums.loss),
    "learning_rate": float(loop.last_metrics["learning_rate"]),
    "tokens_per_sec": tokens_per_step / max(seconds_per_step, 1e-9),
    "grad_norm": float(loop.last_metrics["grad_norm"]),
  }
  if run_config.model.kind == "encoder":
    scalars["train_accuracy"] = sums.mean(sums.correct)
  if sums.steps != run_config.train.log_every_steps:
    # A window cut short (the first one after a resume, the last one of a run): its average
    # covers fewer steps than an uninterrupted run's record of the same step; say how many.
    scalars["train_loss_steps"] = sums.steps
  loop.writer.write(step, scalars)
  note = f"(train_loss over {sums.steps} steps)" if "train_loss_steps" in scalars else ""
  loop.console.line(step, scalars, seconds_per_step, note=note)
  loop.sums = Sums()


def close(loop: Loop) -> None:
  try:
    checkpoint.close(loop.manager)
  finally:
    loop.writer.close()


# ---- Setup ----


def _check_or_replace_config(run_config: RunConfig, workdir: epath.Path) -> None:
  """The resume rule: a rerun keeps DIR/config.json, unless no checkpoint was ever written; a
  workdir with checkpoints but no config.json is refused.

  A run that died before its first checkpoint left nothing to resume, so a corrected config may
  replace it; the earlier attempt's files move to DIR/replaced/ so no record of it mixes in.
  """
  previous = config_lib.read_config_json(workdir)
  steps = checkpoint.finished_steps(workdir)
  if previous is None and steps:
    # Without it the checkpoint would resume as whatever this command line says.
    raise ConfigError(
      f"{workdir} holds checkpoints (steps {', '.join(map(str, steps))}) but no "
      f"{workdir_lib.CONFIG_FILE}, which a resume is checked against: put the run's "
      f"{workdir_lib.CONFIG_FILE} back to resume it, or start a new workdir from these "
      f"parameters with --config.train.init_from={workdir}"
    )
  if previous is None:
    return
  if steps:
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
    # Process 0 may have moved an earlier attempt's files.
    preemption.sync_processes("config checked")
  _warn_about_schedule(run_config)
  init_path = run_config.train.init_from
  if init_path and not epath.Path(init_path).exists():
    raise ConfigError(f"train.init_from={init_path}: no such directory")
  # A Hugging Face decoder fixes the model (its config.json) and the vocabulary (its rows).
  hf_model = init_from.hf_decoder_model(init_path, run_config.model) if init_path else None
  corpus = data_lib.load_corpus(run_config.data, workdir=str(workdir))
  vocab_size = corpus.tokenizer.vocab_size
  if hf_model is not None:
    vocab_size = hf_model.vocab_size
    init_from.check_tokenizer_fits(init_path, vocab_size, corpus.tokenizer, run_config.data)
  if run_config.model.vocab_size != vocab_size:  # a new config, checked anew
    model_cfg = dataclasses.replace(run_config.model, vocab_size=vocab_size)
    run_config = dataclasses.replace(run_config, model=model_cfg)
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
  return Setup(run_config, corpus, mesh, rules, batches)


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
  logging.info(
    "Config: %s; all fields in %s",
    config_lib.summary(setup.run_config, num_params=num_params),
    workdir / workdir_lib.CONFIG_FILE,
  )


# ---- The loop ----


def _setup_or_config_error(run_config: RunConfig, workdir: epath.Path) -> Setup:
  try:
    return _setup(run_config, workdir)
  except ConfigError:
    raise
  except ValueError as e:  # data.DataError, the model's checks: already one clear message
    raise ConfigError(str(e)) from e


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


def _jit_train_step(loop: Loop) -> Any:
  """train_step jitted with the state's shardings, donating the state."""
  run_config, mesh, rules = loop.run_config, loop.setup.mesh, loop.setup.rules
  model_sh = sharding.shardings_of(loop.model_state)
  opt_sh = sharding.shardings_of(loop.opt_state)
  repl = sharding.replicated(mesh)
  return jax.jit(
    functools.partial(
      train_step_lib.train_step,
      model_def=loop.model_def,
      opt_def=loop.opt_def,
      **train_step_lib.train_step_options(run_config),
    ),
    in_shardings=(model_sh, opt_sh, sharding.batch_sharding(mesh, rules), repl),
    out_shardings=(model_sh, opt_sh, repl),
    donate_argnums=(0, 1),
  )


def _compile(loop: Loop, step_fn: Any, batch: dict, step_array: jax.Array) -> Any:
  start = time.perf_counter()
  compiled = step_fn.lower(loop.model_state, loop.opt_state, batch, step_array).compile()
  logging.info(
    "Compiled the train step in %.1fs; training from step %d to %d.",
    time.perf_counter() - start,
    loop.start_step,
    loop.run_config.train.num_train_steps,
  )
  return compiled


def _start(run_config: RunConfig, workdir: epath.Path) -> Loop:
  """Checks the config against the workdir, writes config.json, restores or creates the state."""
  setup = _setup_or_config_error(run_config, workdir)
  run_config = setup.run_config  # with the tokenizer's vocabulary size
  train = run_config.train
  is_main = jax.process_index() == 0
  if is_main:
    config_lib.write_config_json(workdir, run_config)
  tx = make_optimizer(
    run_config.optim,
    train.num_train_steps,
    decay_posenc=POSENCS[run_config.model.posenc.kind].decays_parameters,
  )
  manager = checkpoint.make_manager(workdir, keep=train.keep_checkpoints)
  try:
    model_def, model_state, opt_def, opt_state, start_step = train_state.restore_or_init(
      run_config, setup.mesh, setup.rules, tx, manager, workdir
    )
  except BaseException:
    manager.close()
    raise
  if is_main:
    _log_startup(setup, train_state.count_params(model_state), workdir)
  if start_step >= train.num_train_steps:
    logging.info("Nothing to train: the checkpoint is at step %d.", start_step)
  return Loop(
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
  reading or writing anything there. SIGTERM and SIGINT save a checkpoint, then raise
  RunInterrupted.

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
    StorageFullError: a checkpoint or metrics write found the disk full.
    RunInterrupted: a signal stopped the run after it saved a checkpoint (train.py exits with
      its `exit_status`, 128 + the signal's number).
  """
  workdir = epath.Path(workdir_lib.resolve(str(workdir)))
  run_config = _resolve_paths(config_lib.run_config_from_dict(config))
  with contextlib.ExitStack() as stack:
    _lock(workdir, stack)  # before anything in the workdir is read or written
    loop = _start(run_config, workdir)
    stack.callback(close, loop)
    _train(loop)
  return loop.last_eval


def _train(loop: Loop) -> None:
  """Steps from loop.start_step to train.num_train_steps, or until a signal asks to stop."""
  setup, train = loop.setup, loop.run_config.train
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
        finish_step(loop, *pending)
      pending = (done, metrics)
      stop = preemption.stop_requested(watcher, train, done)
      actions = due(train, done, stop)
      if actions.any:
        finish_step(loop, *pending)
        pending = None
      if actions.log:
        log_train(loop, done)
      if actions.save:
        save(loop, done)
      if stop:
        checkpoint.wait_until_saved(loop.manager)
        logging.warning(
          "%s received: saved the checkpoint of step %d; exiting.",
          watcher.signal_name or "A stop request from another process",
          done,
        )
        raise RunInterrupted(watcher.signal_name or "SIGTERM", done)
      if actions.eval:
        evaluate(loop, done)
    if pending is not None:
      finish_step(loop, *pending)
