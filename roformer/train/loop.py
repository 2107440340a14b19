"""The training loop's state and its periodic actions: finish a step, log, evaluate, save, stop.

roformer/train/trainer.py sets the run up and drives the loop; each action here is one function of
the shared `Loop` state, so the loop itself reads as one flat sequence of steps.
"""

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer.config import RunConfig
from roformer.errors import NonFiniteLossError
from roformer.evals import perplexity as eval_lib
from roformer.infra import checkpoint, metrics_log


@dataclasses.dataclass
class Setup:
  """The validated run: config, corpus, mesh and the batches of this process."""

  run_config: RunConfig
  corpus: Any
  mesh: Any
  rules: tuple
  batches: Any  # data.TrainBatches feeding this process's rows


@dataclasses.dataclass
class Loop:
  """What the loop and its periodic actions share: the run, its live state and its writers."""

  setup: Setup
  workdir: epath.Path
  manager: Any  # the Orbax CheckpointManager of DIR/checkpoints
  writer: metrics_log.MetricsWriter
  console: metrics_log.ConsoleLog
  model_def: Any
  opt_def: Any
  model_state: Any
  opt_state: Any
  start_step: int  # the step the run starts (or resumes) from
  validation: Any = None  # validation tokens, read on the first evaluation
  sums: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3))  # loss, correct, weight
  steps_in_window: int = 0  # steps the sums cover (fewer than log_every_steps after a resume)
  last_metrics: dict = dataclasses.field(default_factory=dict)  # the last finished step's values
  last_eval: dict = dataclasses.field(default_factory=dict)

  @property
  def config(self) -> RunConfig:
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
  """The periodic evaluation: eval_lib at the training length, non-overlapping windows."""
  rc, setup = loop.config, loop.setup
  if loop.validation is None:
    loop.validation = setup.corpus.tokens("validation")
  seq_len, is_encoder = rc.data.seq_len, rc.model.kind == "encoder"
  model = nnx.merge(loop.model_def, loop.model_state)
  start = time.perf_counter()
  with jax.set_mesh(setup.mesh):
    result = eval_lib.evaluate_at_length(
      model,
      loop.validation,
      model_kind=rc.model.kind,
      length=seq_len,
      protocol="nonoverlapping",
      stride=seq_len,
      max_tokens=rc.train.eval_max_tokens,
      max_length=seq_len,
      batch_size=rc.train.eval_batch_size or rc.train.global_batch_size,
      tokenizer=setup.corpus.tokenizer,
      mlm_probability=rc.data.mlm_probability,
      seed=rc.train.seed,
      packed=rc.data.pack,
      randomize_max=rc.model.posenc.randomize_max,
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
  meta = {"step": step, "data": {"next_batch": step, "seed": loop.config.train.seed}}
  checkpoint.save(loop.manager, step, loop.model_state, loop.opt_state, meta)


def last_good(loop: Loop) -> str:
  loop.manager.wait_until_finished()
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
  loop.sums += [values["loss_sum"], values["correct_sum"], values["weight_sum"]]
  loop.steps_in_window += 1
  loop.last_metrics = values
  if loop.console.wants_progress(step):
    loop.console.progress(step, {"train_loss": loop.sums[0] / max(loop.sums[2], 1.0)})


def log_train(loop: Loop, step: int) -> None:
  """Writes the train scalars averaged since the last log; restarts the average."""
  rc = loop.config
  seconds_per_step = loop.console.rate(step)
  tokens_per_step = rc.train.global_batch_size * rc.data.seq_len
  loss_sum, correct_sum, weight_sum = loop.sums
  scalars = {
    "train_loss": loss_sum / max(weight_sum, 1.0),
    "learning_rate": float(loop.last_metrics["learning_rate"]),
    "tokens_per_sec": tokens_per_step / max(seconds_per_step, 1e-9),
    "grad_norm": float(loop.last_metrics["grad_norm"]),
  }
  if rc.model.kind == "encoder":
    scalars["train_accuracy"] = correct_sum / max(weight_sum, 1.0)
  if loop.steps_in_window != rc.train.log_every_steps:
    # A window cut short (the first one after a resume, the last one of a run): its average
    # covers fewer steps than an uninterrupted run's record of the same step; say how many.
    scalars["train_loss_steps"] = loop.steps_in_window
  loop.writer.write(step, scalars)
  note = f"(train_loss over {loop.steps_in_window} steps)" if "train_loss_steps" in scalars else ""
  loop.console.line(step, scalars, seconds_per_step, note=note)
  loop.sums[:] = 0.0
  loop.steps_in_window = 0


def close(loop: Loop) -> None:
  loop.manager.wait_until_finished()
  loop.manager.close()
  loop.writer.close()
