"""Checkpoints in DIR/checkpoints (Orbax): save, resume, restore a model for evaluation, init_from.

A checkpoint holds the items "model" (nnx.state of the model), "optimizer" (nnx.state of the
optimizer) and "meta" (JSON: step and the data iterator position).
"""

import contextlib
import logging as logging_std
import signal
import sys
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer.config import ConfigError, RunConfig
from roformer.errors import CheckpointNotFoundError
from roformer.infra import sharding
from roformer.nn import model as model_lib

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


def _restore_model_state(workdir: epath.Path, step: int | None, abstract_model: Any) -> tuple:
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


def _eval_mesh(run_config: RunConfig):
  """The run's mesh if this machine's device count fits it, else all devices on 'data'."""
  try:
    return sharding.make_mesh(run_config.mesh)
  except ConfigError:
    return sharding.make_mesh(config_lib.MeshConfig(data=-1, fsdp=1, tensor=1))


def restore_model(
  workdir: str | epath.Path, *, step: int | None = None, run_config: RunConfig | None = None
) -> tuple[Any, int]:
  """The model of a training run's checkpoint, for evaluation.

  Args:
    workdir: the run's workdir (holding config.json and checkpoints/).
    step: the checkpoint's step; None = the latest.
    run_config: overrides DIR/config.json (e.g. with a RoPE scaling for evaluation; parameter
      shapes must not change).

  Returns:
    (model, step): the nnx model with its parameters sharded over this machine's devices.

  Raises:
    CheckpointNotFoundError: "no checkpoint in DIR/checkpoints" (or no such step).
  """
  workdir = epath.Path(workdir)
  run_config = run_config or config_lib.load_run_config(workdir)
  mesh = _eval_mesh(run_config)
  rules = sharding.axis_rules(run_config.mesh)
  make = lambda: model_lib.make_model(run_config.model, rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, abstract = sharding.abstract_state(make, mesh, rules)
  state, step = _restore_model_state(workdir, step, abstract)
  return nnx.merge(graphdef, state), step


# ---- init_from: parameters of another run or of a Hugging Face RoFormer ----


def _is_hf_dir(path: epath.Path) -> bool:
  return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def _run_workdir(path: epath.Path) -> tuple[epath.Path, int | None] | None:
  """(workdir, step) if `path` is a run's workdir, its checkpoints/ or one checkpoint in it."""
  if (path / CHECKPOINT_DIR).exists():
    return path, None
  if path.name == CHECKPOINT_DIR:
    return path.parent, None
  if path.parent.name == CHECKPOINT_DIR and path.name.isdigit():
    return path.parent.parent, int(path.name)
  return None


def _place_like(source: Any, target: Any, origin: str) -> Any:
  """`source`'s arrays (matched by path) placed with the dtypes and shardings of `target`."""
  source_leaves = {
    jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(source)
  }
  target_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  problems, placed = [], []
  for path, abstract in target_leaves:
    name = jax.tree_util.keystr(path)
    value = source_leaves.get(name)
    if value is None:
      problems.append(f"{name} missing")
    elif tuple(np.shape(value)) != tuple(abstract.shape):
      problems.append(
        f"{name} has shape {tuple(np.shape(value))}, this model needs {abstract.shape}"
      )
    else:
      placed.append(jax.device_put(np.asarray(value, dtype=abstract.dtype), abstract.sharding))
  if problems:
    shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
    raise ConfigError(
      f"train.init_from={origin}: its parameters do not fit this model's config ({shown})"
    )
  return jax.tree_util.tree_unflatten(treedef, placed)


def load_init_state(init_from: str, abstract_model: Any, model_cfg=None) -> Any:
  """Model state from train.init_from, placed with the shardings of `abstract_model`.

  Args:
    init_from: another run's workdir (or its checkpoints/ dir, or one checkpoint step dir), or a
      Hugging Face RoFormerForMaskedLM directory (config.json + model.safetensors).
    abstract_model: nnx state of jax.ShapeDtypeStruct (with shardings) of this run's model.
    model_cfg: this run's ModelConfig; a checkpoint that does not fit is then explained by the
      parameters whose shapes differ and the config fields behind them.

  Raises:
    ConfigError naming train.init_from when the path is not usable or the shapes differ.
  """
  path = epath.Path(init_from)
  if not path.exists():
    raise ConfigError(f"train.init_from={init_from}: no such directory")
  run = _run_workdir(path)
  if run is not None:
    workdir, step = run
    # Shapes first: a restore into other shapes fails deep inside Orbax, after reading arrays.
    misfit = _misfit(workdir, abstract_model, model_cfg) if model_cfg is not None else ""
    if misfit:
      raise ConfigError(
        f"train.init_from={init_from}: its checkpoint does not fit this model's config ({misfit})"
      )
    try:
      state, step = _restore_model_state(workdir, step, abstract_model)
    except CheckpointNotFoundError as e:
      raise ConfigError(f"train.init_from={init_from}: {e}") from e
    except (ValueError, KeyError) as e:
      raise ConfigError(
        f"train.init_from={init_from}: its checkpoint does not fit this model's config "
        f"({str(e).splitlines()[0]})"
      ) from None
    logging.info("Initialised parameters from %s (step %d).", workdir, step)
    return state
  if _is_hf_dir(path):
    from roformer import hf

    if "layers" in abstract_model and 0 not in abstract_model["layers"]:  # stacked blocks
      raise ConfigError(
        f"train.init_from={init_from}: Hugging Face checkpoints load only into "
        "model.scan_layers=False"
      )

    loaded = hf.load_hf_roformer(str(path))
    state = _place_like(nnx.state(loaded.model), abstract_model, init_from)
    logging.info("Initialised parameters from the Hugging Face RoFormer in %s.", path)
    return state
  raise ConfigError(
    f"train.init_from={init_from}: expected a training workdir (with {CHECKPOINT_DIR}/) or a "
    "Hugging Face RoFormer directory (config.json + *.safetensors)"
  )


def _misfit(workdir: epath.Path, abstract_model: Any, model_cfg) -> str:
  """The parameters whose shapes differ between `workdir`'s run and this model, and the model
  config fields that differ (what a command-line user can change); "" if every shape fits (or
  the run's config cannot be read)."""
  import dataclasses

  try:
    source_cfg = config_lib.load_run_config(workdir).model
    source = nnx.state(nnx.eval_shape(lambda: model_lib.make_model(source_cfg, rngs=nnx.Rngs(0))))
  except (FileNotFoundError, ValueError):
    return ""

  def shapes(tree):
    return {
      jax.tree_util.keystr(path): tuple(leaf.shape)
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
      if hasattr(leaf, "shape")
    }

  there, here = shapes(source), shapes(abstract_model)
  params = [
    f"{_param_name(name)} {there.get(name, 'absent')} there, {here.get(name, 'absent')} here"
    for name in sorted(set(there) | set(here))
    if there.get(name) != here.get(name)
  ]
  if not params:
    return ""

  def flat(cfg, prefix):
    out = {}
    for field in dataclasses.fields(cfg):
      value = getattr(cfg, field.name)
      name = "posenc" if field.name == "posenc" else f"{prefix}.{field.name}"
      if dataclasses.is_dataclass(value):
        out.update(flat(value, name))
      else:
        out[name] = value
    return out

  old, new = flat(source_cfg, "model"), flat(model_cfg, "model")
  fields = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old) if old[k] != new.get(k)]
  shown = "; ".join(params[:4]) + ("; ..." if len(params) > 4 else "")
  return f"parameters {shown}; config fields {', '.join(fields) or 'none'}"


def _param_name(keystr: str) -> str:
  """ "['layers'][0]['attn']" -> "layers/0/attn"."""
  return "/".join(p.strip("'") for p in keystr.strip("[]").split("]["))


# ---- Preemption ----


class PreemptionWatcher:
  """Turns SIGTERM (a TPU preemption, `kill`) and SIGINT (Ctrl-C) into a flag the loop reads.

  The loop saves a checkpoint at the next step boundary and exits. A second Ctrl-C interrupts at
  once (KeyboardInterrupt), without saving.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self._event = threading.Event()
    self._previous = {}
    self.signal_name = ""  # the first signal received, e.g. "SIGINT"

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}
    return False

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self._event.is_set():
      raise KeyboardInterrupt  # the second Ctrl-C: stop now
    self.signal_name = self.signal_name or signal.Signals(signum).name
    self._event.set()

  def requested(self) -> bool:
    return self._event.is_set()
