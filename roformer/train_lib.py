"""Training: optimizer, the jitted train step, and the loop (evaluation, checkpoints, metrics).

Entry point: `train_and_evaluate(config, workdir)` (train.py is a thin CLI over it).
"""

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

from roformer import checkpoint, config_lib, eval_lib, metrics_log, prefetch, sharding
from roformer import data as data_lib
from roformer import model as model_lib
from roformer.config_lib import ConfigError, OptimConfig, RunConfig


class NonFiniteLossError(RuntimeError):
  """Training produced a NaN or infinite loss or gradient."""


# ---- Optimizer ----


def make_schedule(optim: OptimConfig, num_train_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine | linear decay (or constant) to the last step."""
  peak = optim.learning_rate
  end = peak * optim.final_learning_rate_fraction
  decay_steps = max(num_train_steps - optim.warmup_steps, 1)
  if optim.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim.final_learning_rate_fraction)
  elif optim.schedule == "linear":
    decay = optax.linear_schedule(peak, end, decay_steps)
  else:
    decay = optax.constant_schedule(peak)
  if optim.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak, optim.warmup_steps)
  return optax.join_schedules([warmup, decay], [optim.warmup_steps])


def decay_mask(params: Any) -> Any:
  """True for parameters that get weight decay: matrices and tables, not norms or biases."""
  return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(optim: OptimConfig, num_train_steps: int) -> optax.GradientTransformation:
  """AdamW with the schedule, weight decay masked off 1-D parameters, global-norm clipping."""
  adamw = optax.adamw(
    make_schedule(optim, num_train_steps),
    b1=optim.b1,
    b2=optim.b2,
    eps=optim.eps,
    weight_decay=optim.weight_decay,
    mask=decay_mask,
  )
  if optim.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(optim.grad_clip_norm), adamw)
  return adamw


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
  packed: bool = True,
  max_predictions: int = 0,
):
  """One optimizer step on a global batch; returns (model_state, opt_state, metrics).

  Without `packed`, every row is one document and the segment ids are dropped (no segment mask
  in attention); `max_predictions` is `loss_sums`'.

  The loss is the sum of weighted token losses divided by the batch's total weight, so gradient
  accumulation over microbatches gives the same update as one big batch. Dropout keys are
  fold_in(key(seed), step) (then the microbatch index): a resumed run draws the same masks.
  """
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
  # A finite loss and gradient can still overflow the update into inf parameters.
  params_finite = jnp.all(
    jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
  )
  metrics = dict(
    sums, grad_norm=grad_norm, params_finite=params_finite, learning_rate=schedule(step)
  )
  return nnx.state(model), nnx.state(optimizer), metrics


# ---- Setup ----


@dataclasses.dataclass
class _Setup:
  run_config: RunConfig
  corpus: Any
  mesh: Any
  rules: tuple
  batches: Any  # data.TrainBatches feeding this process's rows


def _setup(config: Any, workdir: epath.Path) -> _Setup:
  """Everything that can fail on bad input, before any compiling or checkpoint is touched."""
  run_config = config_lib.run_config_from_dict(config)
  previous = config_lib.read_config_json(workdir)
  if previous is not None:
    config_lib.check_resume(previous, run_config)
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
  batches = data_lib.TrainBatches(
    corpus,
    run_config.data,
    model_kind=run_config.model.kind,
    global_batch_size=train.global_batch_size,
    seed=train.seed,
    process_index=batch_index,
    process_count=batch_count,
  )
  if train.init_from and not epath.Path(train.init_from).exists():
    raise ConfigError(f"train.init_from={train.init_from}: no such directory")
  return _Setup(run_config, corpus, mesh, rules, batches)


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


def _log_startup(setup: _Setup, num_params: int, workdir: epath.Path) -> None:
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


def train_and_evaluate(config: Any, workdir: str) -> dict:
  """Trains (or resumes) the run in `workdir` and evaluates it periodically on validation data.

  Args:
    config: a ConfigDict of configs/default.py's layout (or the same as a nested dict).
    workdir: the run directory (local path or gs://...).

  Returns:
    The last evaluation's metrics ({} without evaluation).

  Raises:
    ConfigError: bad input (config value, data, mesh), raised before compiling or touching a
      checkpoint; the message names the field.
    NonFiniteLossError: the loss or gradient became NaN or infinite.
  """
  workdir = epath.Path(workdir)
  try:
    setup = _setup(config, workdir)
  except ConfigError:
    raise
  except ValueError as e:  # data.DataError, the model's checks: already one clear message
    raise ConfigError(str(e)) from e
  rc = setup.run_config
  train, optim = rc.train, rc.optim
  is_main = jax.process_index() == 0
  if is_main:
    config_lib.write_config_json(workdir, rc)

  mesh, rules = setup.mesh, setup.rules
  tx = make_optimizer(optim, train.num_train_steps)
  manager = checkpoint.make_manager(workdir, keep=train.keep_checkpoints)
  latest = manager.latest_step()
  start_step = latest or 0
  if latest is not None:
    model_def, model_abs, opt_def, opt_abs = abstract_train_state(rc, tx, mesh, rules)
    model_state, opt_state, meta = checkpoint.restore(manager, start_step, model_abs, opt_abs)
    logging.info("Resumed from the checkpoint of step %d (%s).", start_step, meta)
  else:
    model_def, model_state, opt_def, opt_state = create_train_state(rc, tx, mesh, rules)
    if train.init_from:
      model_state = checkpoint.load_init_state(train.init_from, _abstract(model_state))
  model_sh, opt_sh = sharding.shardings_of(model_state), sharding.shardings_of(opt_state)
  if is_main:
    _log_startup(setup, _count_params(model_state), workdir)

  batches = setup.batches
  batch_sh = sharding.batch_sharding(mesh, rules)
  repl = sharding.replicated(mesh)
  step_fn = jax.jit(
    functools.partial(train_step, model_def=model_def, opt_def=opt_def, **train_step_options(rc)),
    in_shardings=(model_sh, opt_sh, batch_sh, repl),
    out_shardings=(model_sh, opt_sh, repl),
    donate_argnums=(0, 1),
  )

  writer = metrics_log.MetricsWriter(workdir, enabled=is_main)
  console = metrics_log.ConsoleLog(train.num_train_steps, enabled=is_main)
  tokens_per_step = train.global_batch_size * rc.data.seq_len
  is_encoder = rc.model.kind == "encoder"
  validation = None
  last_eval: dict = {}

  def evaluate(step: int) -> None:
    nonlocal validation, last_eval
    if validation is None:
      validation = setup.corpus.tokens("validation")
    seq_len = rc.data.seq_len
    model = nnx.merge(model_def, model_state)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
      result = eval_lib.evaluate_at_length(
        model,
        validation,
        model_kind=rc.model.kind,
        length=seq_len,
        protocol="nonoverlapping",
        stride=seq_len,
        max_tokens=train.eval_max_tokens,
        max_length=seq_len,
        batch_size=train.eval_batch_size or train.global_batch_size,
        tokenizer=setup.corpus.tokenizer,
        mlm_probability=rc.data.mlm_probability,
        seed=train.seed,
      )
    scalars = {
      "eval_loss": result["loss"],
      "eval_ppl": result["ppl"],
      "eval_tokens": result["tokens"],
    }
    if is_encoder:
      scalars["eval_accuracy"] = result["accuracy"]
    writer.write(step, scalars)
    logging.info(
      "step %d: eval_loss %.4f (ppl %.3f) on %d validation tokens in %.1fs%s",
      step,
      result["loss"],
      result["ppl"],
      result["tokens"],
      time.perf_counter() - start,
      f", eval_accuracy {result['accuracy']:.4f}" if is_encoder else "",
    )
    last_eval = result

  def save(step: int) -> None:
    meta = {"step": step, "data": {"next_batch": step, "seed": train.seed}}
    checkpoint.save(manager, step, model_state, opt_state, meta)

  def last_good() -> str:
    manager.wait_until_finished()
    good = manager.latest_step()
    return (
      f"The last good checkpoint is step {good} in {checkpoint.checkpoint_dir(workdir)} "
      "(kept intact)."
      if good is not None
      else "No checkpoint was saved."
    )

  sums = np.zeros(3)  # loss, correct, weight since the last log
  last_metrics: dict = {}

  def finish(step: int, metrics: dict) -> None:
    """Pulls one step's metrics to host; stops the run on a non-finite loss or gradient."""
    nonlocal last_metrics
    values = jax.device_get(metrics)
    loss = values["loss_sum"] / max(values["weight_sum"], 1.0)
    if not (np.isfinite(loss) and np.isfinite(values["grad_norm"]) and values["params_finite"]):
      raise NonFiniteLossError(
        f"non-finite loss at step {step} (loss {loss}, grad_norm {values['grad_norm']}, "
        f"parameters finite: {bool(values['params_finite'])}); the run stopped. {last_good()}"
      )
    sums[:] += [values["loss_sum"], values["correct_sum"], values["weight_sum"]]
    last_metrics = values

  def log(step: int) -> None:
    seconds_per_step = console.rate(step)
    scalars = {
      "train_loss": sums[0] / max(sums[2], 1.0),
      "learning_rate": float(last_metrics["learning_rate"]),
      "tokens_per_sec": tokens_per_step / max(seconds_per_step, 1e-9),
      "grad_norm": float(last_metrics["grad_norm"]),
    }
    if is_encoder:
      scalars["train_accuracy"] = sums[1] / max(sums[2], 1.0)
    writer.write(step, scalars)
    console.line(step, scalars, seconds_per_step)
    sums[:] = 0.0

  if start_step >= train.num_train_steps:
    logging.info("Nothing to train: the checkpoint is at step %d.", start_step)
  compiled = None

  def load(step: int):  # runs on the prefetch thread, ahead of the step that uses it
    return sharding.put_batch(batches.batch(step), mesh, rules, train.global_batch_size)

  steps = range(start_step, train.num_train_steps)
  with checkpoint.PreemptionWatcher() as watcher, prefetch.Prefetcher(load, steps) as prefetched:
    try:
      pending = None
      for step, batch in prefetched:
        step_array = jnp.asarray(step, jnp.int32)
        if compiled is None:
          start = time.perf_counter()
          compiled = step_fn.lower(model_state, opt_state, batch, step_array).compile()
          logging.info(
            "Compiled the train step in %.1fs; training from step %d to %d.",
            time.perf_counter() - start,
            start_step,
            train.num_train_steps,
          )
          console.start(start_step)
        model_state, opt_state, metrics = compiled(model_state, opt_state, batch, step_array)
        done = step + 1
        # Pull the previous step's metrics after dispatching this one: the host never idles.
        if pending is not None:
          finish(*pending)
        pending = (done, metrics)
        stop = watcher.requested()
        if jax.process_count() > 1:
          # Processes agree on stopping only at logging steps (one collective per interval).
          stop = done % train.log_every_steps == 0 and _any_process(stop)
        last = done == train.num_train_steps
        log_now = done % train.log_every_steps == 0 or last
        save_now = (
          last
          or stop
          or (train.checkpoint_every_steps and done % train.checkpoint_every_steps == 0)
        )
        eval_now = train.eval_max_tokens > 0 and (
          last or (train.eval_every_steps and done % train.eval_every_steps == 0)
        )
        if log_now or save_now or eval_now:
          finish(*pending)
          pending = None
        if log_now:
          log(done)
        if save_now:
          save(done)
        if stop:
          manager.wait_until_finished()
          logging.warning("SIGTERM received: saved the checkpoint of step %d; exiting.", done)
          break
        if eval_now:
          evaluate(done)
          console.start(done)  # evaluation time is not training throughput
      if pending is not None:
        finish(*pending)
    finally:
      manager.wait_until_finished()
      manager.close()
      writer.close()
  return last_eval


def _any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (all processes stop at the same step)."""
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.array([flag], np.int32))
  return bool(np.max(flags))
