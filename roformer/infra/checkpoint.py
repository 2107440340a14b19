"""Checkpoints in DIR/checkpoints (Orbax): save, restore, and set aside the unreadable ones.

A checkpoint holds the items "model" (nnx.state of the model), "optimizer" (nnx.state of the
optimizer) and "meta" (JSON: step and the data iterator position).
"""

import contextlib
import logging as logging_std
import sys
from typing import Any

import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from roformer.errors import CheckpointNotFoundError

CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(workdir: str | epath.Path) -> epath.Path:
  return epath.Path(workdir) / CHECKPOINT_DIR


def finished_steps(workdir: str | epath.Path) -> list[int]:
  """Steps of the complete checkpoints in DIR/checkpoints (Orbax renames a step's tmp dir last)."""
  root = checkpoint_dir(workdir)
  if not root.exists():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def make_manager(workdir: str | epath.Path, *, keep: int = 3, read_only: bool = False):
  """The Orbax CheckpointManager of DIR/checkpoints, keeping the `keep` latest checkpoints."""
  # Readers use a plain manager that creates nothing (Orbax's read_only mode warns on every use).
  options = ocp.CheckpointManagerOptions(
    max_to_keep=None if read_only else keep,
    create=not read_only,
    enable_async_checkpointing=not read_only,
  )
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def save(manager, step: int, model_state: Any, opt_state: Any, meta: dict) -> None:
  """Starts saving (asynchronously; arrays are copied off the devices before it returns)."""
  manager.save(
    step,
    args=ocp.args.Composite(
      model=ocp.args.StandardSave(model_state),
      optimizer=ocp.args.StandardSave(opt_state),
      meta=ocp.args.JsonSave(meta),
    ),
    force=True,
  )


def restore(manager, step: int, abstract_model: Any, abstract_opt: Any) -> tuple[Any, Any, dict]:
  """Restores (model_state, opt_state, meta) of `step` into sharded abstract targets."""
  restored = manager.restore(
    step,
    args=ocp.args.Composite(
      model=ocp.args.StandardRestore(abstract_model),
      optimizer=ocp.args.StandardRestore(abstract_opt),
      meta=ocp.args.JsonRestore(),
    ),
  )
  return restored.model, restored.optimizer, dict(restored.meta)


UNREADABLE_DIR = "unreadable_checkpoints"


def _first_line(error: Exception, limit: int = 200) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:limit] if text else ''}"


def restore_latest_readable(manager, abstract_model: Any, abstract_opt: Any) -> tuple:
  """Restores the newest checkpoint that reads back, newest first.

  A checkpoint can be complete for Orbax yet damaged on disk (a truncated or lost file, e.g. after
  a full disk or a partial copy). Such a step is skipped with a warning naming it; the caller
  moves it aside with `set_aside` once it has a good state.

  Returns:
    (model_state, opt_state, meta, step, unreadable): `unreadable` lists the skipped steps.

  Raises:
    CheckpointNotFoundError (one line) when no checkpoint reads back.
  """
  unreadable = []
  _drop_closed_loop_reports()  # a damaged step's pending reads report as they finish
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      with _orbax_logs_silenced():
        model_state, opt_state, meta = restore(manager, step, abstract_model, abstract_opt)
    except Exception as e:  # Orbax and TensorStore raise many types for damaged files
      logging.warning(
        "The checkpoint of step %d in %s is unreadable (%s); trying the previous one.",
        step,
        manager.directory,
        _first_line(e),
      )
      unreadable.append((step, _first_line(e)))
      continue
    return model_state, opt_state, meta, step, [s for s, _ in unreadable]
  details = "; ".join(f"step {s}: {why}" for s, why in unreadable)
  raise CheckpointNotFoundError(
    f"no checkpoint in {manager.directory} reads back ({details}); move that directory away to "
    "train from scratch"
  )


class _NotOrbax(logging_std.Filter):
  def filter(self, record: logging_std.LogRecord) -> bool:
    return "/orbax/" not in record.pathname


@contextlib.contextmanager
def _orbax_logs_silenced():
  """Drops Orbax's own log records (it logs a damaged array's error with a traceback before
  raising it); `restore_latest_readable` reports the failure itself, in one line."""
  loggers = [logging_std.getLogger("absl"), logging_std.getLogger()]
  handlers = [h for logger in loggers for h in logger.handlers]
  drop = _NotOrbax()
  for target in loggers + handlers:
    target.addFilter(drop)
  try:
    yield
  finally:
    for target in loggers + handlers:
      target.removeFilter(drop)


def _drop_closed_loop_reports() -> None:
  """After a failed restore, Orbax's other pending reads of the damaged step finish after its
  event loop closed: each prints "RuntimeError: Event loop is closed", or is garbage-collected
  with its read error ("Exception ignored in: <coroutine ...>", "Task exception was never
  retrieved"). Those reports say nothing the one-line warning does not: drop exactly them
  (sys.excepthook, sys.unraisablehook and asyncio's log keep every other error)."""
  if getattr(sys.excepthook, "drops_closed_loop", False):
    return

  def closed_loop(exc) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"

  def from_orbax(tb) -> bool:
    while tb is not None:
      if "/orbax/" in tb.tb_frame.f_code.co_filename:
        return True
      tb = tb.tb_next
    return False

  previous_except, previous_unraisable = sys.excepthook, sys.unraisablehook

  def excepthook(kind, exc, tb):
    if not closed_loop(exc):
      previous_except(kind, exc, tb)

  def unraisablehook(report):
    if not (closed_loop(report.exc_value) or from_orbax(report.exc_traceback)):
      previous_unraisable(report)

  class NotOrbaxRead(logging_std.Filter):  # asyncio's "Task exception was never retrieved"
    def filter(self, record):
      return not (record.exc_info and from_orbax(record.exc_info[2]))

  excepthook.drops_closed_loop = True
  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
  logging_std.getLogger("asyncio").addFilter(NotOrbaxRead())


def set_aside(workdir: str | epath.Path, step: int) -> epath.Path:
  """Moves an unreadable step out of DIR/checkpoints (so it is neither resumed nor overwritten)."""
  target = epath.Path(workdir) / UNREADABLE_DIR / str(step)
  if target.exists():
    target = target.with_name(f"{step}.{len(list(target.parent.iterdir()))}")
  target.parent.mkdir(parents=True, exist_ok=True)
  (checkpoint_dir(workdir) / str(step)).rename(target)
  return target


def restore_model_state(workdir: epath.Path, step: int | None, abstract_model: Any) -> tuple:
  if not checkpoint_dir(workdir).exists():
    raise CheckpointNotFoundError(f"no checkpoint in {checkpoint_dir(workdir)}")
  manager = make_manager(workdir, read_only=True)
  try:
    steps = manager.all_steps()
    if not steps:
      raise CheckpointNotFoundError(f"no checkpoint in {checkpoint_dir(workdir)}")
    if step is None:
      step = max(steps)
    elif step not in steps:
      raise CheckpointNotFoundError(
        f"no checkpoint of step {step} in {checkpoint_dir(workdir)}; steps there: "
        + ", ".join(str(s) for s in sorted(steps))
      )
    restored = manager.restore(
      step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract_model))
    )
    return restored.model, step
  finally:
    manager.close()


# ---- init_from: parameters of another run or of a Hugging Face RoFormer ----


# ---- Preemption ----
