"""Checkpoints in DIR/checkpoints (Orbax): save, restore, and set aside the unreadable ones.

A checkpoint holds the items "model" (nnx.state of the model), "optimizer" (nnx.state of the
optimizer) and "meta" (JSON: step and the data iterator position), and the manifest of its files
(roformer/infra/manifest.py), checked before every restore.
"""

import contextlib
import errno
import logging as logging_std
import sys
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from roformer.errors import CheckpointNotFoundError, StorageFullError, is_disk_full
from roformer.infra import manifest

CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(workdir: str | epath.Path) -> epath.Path:
  return epath.Path(workdir) / CHECKPOINT_DIR


def finished_steps(workdir: str | epath.Path) -> list[int]:
  """Steps of the complete checkpoints in DIR/checkpoints (Orbax renames a step's tmp dir last)."""
  root = checkpoint_dir(workdir)
  if not root.exists():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


class _Manager(ocp.CheckpointManager):
  """Orbax's CheckpointManager, writing each saved step's manifest before Orbax commits it.

  Orbax calls the manifest writer in its background save thread on process 0, once every
  process has written its files and before the step's temporary directory is renamed (or, on an
  object store, marked committed): a committed step always carries its manifest.
  """

  def __init__(self, directory: epath.Path, options: ocp.CheckpointManagerOptions):
    self.saving = None  # the step of the save in flight
    options.async_options = ocp.AsyncOptions(post_finalization_callback=self._write_manifest)
    super().__init__(directory, options=options)

  def save(self, step: int, *args, **kwargs) -> bool:
    self.wait_until_finished()  # the previous step's manifest is written: `saving` may change
    self.saving = step
    return super().save(step, *args, **kwargs)

  def _write_manifest(self) -> None:
    tmp = self.directory / f"{self.saving}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}"
    manifest.write(tmp if tmp.exists() else self.directory / str(self.saving))


def make_manager(workdir: str | epath.Path, *, keep: int = 3, read_only: bool = False):
  """The Orbax CheckpointManager of DIR/checkpoints, keeping the `keep` latest checkpoints."""
  # Readers use a plain manager that creates nothing (Orbax's read_only mode warns on every use).
  options = ocp.CheckpointManagerOptions(
    max_to_keep=None if read_only else keep,
    create=not read_only,
    enable_async_checkpointing=not read_only,
  )
  if read_only:
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)
  _report_disk_full_once()
  _drop_closed_loop_reports()  # a failed save's pending writes report as they finish
  return _Manager(checkpoint_dir(workdir), options=options)


def save(manager, step: int, model_state: Any, opt_state: Any, meta: dict) -> None:
  """Starts saving (asynchronously; arrays are copied off the devices before it returns).

  Raises:
    StorageFullError (one line) when this or the previous save found the disk full.
  """
  wait_until_saved(manager)
  with _disk_full_in_one_line(manager, step):
    manager.save(
      step,
      args=ocp.args.Composite(
        model=ocp.args.StandardSave(model_state),
        optimizer=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta),
      ),
      force=True,
    )


def wait_until_saved(manager) -> None:
  """Waits for the save in flight to be committed.

  Raises:
    StorageFullError (one line) when the disk was full.
  """
  with _disk_full_in_one_line(manager, getattr(manager, "saving", None)):
    manager.wait_until_finished()


def close(manager) -> None:
  """Waits for the last save and closes `manager`.

  Raises:
    StorageFullError (one line) when the disk was full.
  """
  with _disk_full_in_one_line(manager, getattr(manager, "saving", None)):
    manager.close()


@contextlib.contextmanager
def _disk_full_in_one_line(manager, step: int | None):
  """Re-raises an error of the block that a full disk caused as StorageFullError (one line)
  naming `step`; other errors unchanged."""
  try:
    yield
  except Exception as e:
    _raise_if_disk_full(e, manager, step)
    raise


# ---- A full disk: one line, not Orbax's tracebacks ----


def _raise_if_disk_full(error: Exception, manager, step: int | None) -> None:
  if not is_disk_full(error):
    return
  root = epath.Path(manager.directory)
  good = [s for s in finished_steps(root.parent) if s != step]
  kept = f"the last complete checkpoint is step {good[-1]}" if good else "no checkpoint is complete"
  what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
  raise StorageFullError(
    errno.ENOSPC,
    f"cannot save {what} in {root}: the disk is full (no space left on device); {kept}: free "
    "some space, then rerun to resume",
  ) from None


class _NotDiskFull(logging_std.Filter):
  def filter(self, record: logging_std.LogRecord) -> bool:
    return not (record.exc_info and is_disk_full(record.exc_info[1]))


def _report_disk_full_once() -> None:
  """Drops the records that Orbax logs, each with its traceback, when a save fails on a full
  disk (from its save threads, then again as it re-raises): `save` and `wait_until_saved` report
  it in one line."""
  absl_logger = logging_std.getLogger("absl")
  if not any(isinstance(f, _NotDiskFull) for f in absl_logger.filters):
    absl_logger.addFilter(_NotDiskFull())


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


class _Unreadable(Exception):
  """A step failed its manifest check or did not read back; the message says why, in a phrase."""


def _read_checked(manager, step: int, read: Callable[[], Any]) -> Any:
  """`read()` of `step` once its files match its manifest.

  A checkpoint can be complete for Orbax yet damaged on disk (a truncated, lost or overwritten
  file, e.g. after a full disk or a partial copy); overwritten bytes often read back as other
  numbers without an error, so the manifest is checked first.

  Raises:
    _Unreadable, naming the file at fault or quoting the reader's error.
  """
  step_dir = epath.Path(manager.directory) / str(step)
  try:
    checked = manifest.verify(step_dir)
  except (manifest.ManifestMismatchError, OSError) as e:
    raise _Unreadable(str(e)) from None
  if not checked:
    logging.info(
      "The checkpoint of step %d has no %s (saved before checkpoints carried one): its files are "
      "not checked.",
      step,
      manifest.MANIFEST_FILE,
    )
  _drop_closed_loop_reports()  # a damaged step's pending reads report as they finish
  try:
    with _orbax_logs_silenced():
      return read()
  except Exception as e:  # Orbax and TensorStore raise many types for damaged files
    raise _Unreadable(_first_line(e)) from None


def restore_latest_readable(manager, abstract_model: Any, abstract_opt: Any) -> tuple:
  """Restores the newest checkpoint that reads back, newest first.

  A damaged step (see `_read_checked`) is skipped; the caller says so and moves it aside with
  `set_aside` once it has a good state.

  Returns:
    (model_state, opt_state, meta, step, unreadable): `unreadable` lists the skipped steps as
    (step, why) pairs, newest first.

  Raises:
    CheckpointNotFoundError (one line) when no checkpoint reads back.
  """
  unreadable = []
  for step in sorted(manager.all_steps(), reverse=True):
    read = lambda step=step: restore(manager, step, abstract_model, abstract_opt)  # noqa: E731
    try:
      model_state, opt_state, meta = _read_checked(manager, step, read)
    except _Unreadable as e:
      unreadable.append((step, str(e)))
      continue
    return model_state, opt_state, meta, step, unreadable
  raise CheckpointNotFoundError(
    f"no checkpoint in {manager.directory} reads back ({_why(unreadable)}); move that directory "
    "away to train from scratch"
  )


def _why(unreadable: list[tuple[int, str]]) -> str:
  return "; ".join(f"step {step}: {why}" for step, why in unreadable)


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
  """The model state of checkpoint `step`, or of the newest readable one (`step` None).

  Reads only: a damaged newer checkpoint is skipped with one warning line naming it and the step
  used instead, and left where it is (train.py moves it aside when it resumes).

  Returns:
    (model_state, step).

  Raises:
    CheckpointNotFoundError (one line): no checkpoint, no such step, the given step unreadable,
    or none readable.
  """
  root = checkpoint_dir(workdir)
  if not root.exists():
    raise CheckpointNotFoundError(f"no checkpoint in {root}")
  manager = make_manager(workdir, read_only=True)
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise CheckpointNotFoundError(f"no checkpoint in {root}")
    listed = ", ".join(str(s) for s in steps)
    if step is not None and step not in steps:
      raise CheckpointNotFoundError(
        f"no checkpoint of step {step} in {root}; steps there: {listed}"
      )
    unreadable = []
    for candidate in [step] if step is not None else steps[::-1]:
      args = ocp.args.Composite(model=ocp.args.StandardRestore(abstract_model))
      read = lambda s=candidate, args=args: manager.restore(s, args=args).model  # noqa: E731
      try:
        state = _read_checked(manager, candidate, read)
      except _Unreadable as e:
        unreadable.append((candidate, str(e)))
        continue
      if unreadable:
        logging.warning(
          "Unreadable checkpoint%s in %s (%s): using the checkpoint of step %d.",
          "s" if len(unreadable) > 1 else "",
          root,
          _why(unreadable),
          candidate,
        )
      return state, candidate
    if step is not None:
      raise CheckpointNotFoundError(
        f"the checkpoint of step {step} in {root} is unreadable ({unreadable[0][1]}); steps "
        f"there: {listed}"
      )
    raise CheckpointNotFoundError(f"no checkpoint in {root} reads back ({_why(unreadable)})")
  finally:
    manager.close()


# ---- init_from: parameters of another run or of a Hugging Face RoFormer ----


# ---- Preemption ----
