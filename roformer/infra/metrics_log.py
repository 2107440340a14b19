"""Training metrics: DIR/metrics.jsonl, TensorBoard scalars in DIR, and console lines.

Only process 0 writes; on other processes every method does nothing.
"""

import json
import logging as logging_std
import math
import sys
import time
from typing import Any

import jax
from absl import logging
from etils import epath

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
  """JSON-safe scalars (NaN and infinities as strings, which json.loads reads back as floats)."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


def _import_tensorboardx():
  """tensorboardX without torch: it imports torch when installed (seconds, and unused here)."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
  try:
    import tensorboardX
  finally:
    if blocked:
      del sys.modules["torch"]
  return tensorboardX


class MetricsWriter:
  """Appends one JSON object per record to DIR/metrics.jsonl and mirrors scalars to TensorBoard."""

  def __init__(self, workdir: str | epath.Path, *, enabled: bool | None = None):
    self._enabled = jax.process_index() == 0 if enabled is None else enabled
    self._path = epath.Path(workdir) / METRICS_FILE
    # Object stores cannot append: keep the text and rewrite it (metrics files stay small).
    self._rewrite = "://" in str(workdir)
    self._text = ""
    self._tb = None
    if not self._enabled:
      return
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    if self._rewrite and self._path.exists():
      self._text = self._path.read_text()
    self._tb = _import_tensorboardx().SummaryWriter(logdir=str(workdir))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Writes {"step": step, **scalars} as one line, and each scalar to TensorBoard."""
    if not self._enabled:
      return
    record = {"step": int(step), **{k: _clean(float(v)) for k, v in scalars.items()}}
    line = json.dumps(record) + "\n"
    if self._rewrite:
      self._text += line
      self._path.write_text(self._text)
    else:
      with self._path.open("a") as f:
        f.write(line)
    for name, value in scalars.items():
      self._tb.add_scalar(name, float(value), int(step))
    self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


class _DropChatter(logging_std.Filter):
  """Drops INFO records of libraries that log every checkpoint step (Orbax)."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    return record.levelno >= logging_std.WARNING or "/orbax/" not in record.pathname


def quiet_library_logs() -> None:
  """Keeps the console to this program's lines: Orbax's INFO chatter is dropped."""
  logging_std.getLogger("absl").addFilter(_DropChatter())


def format_duration(seconds: float) -> str:
  seconds = max(0, int(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


# Scalars of the console line, in order, with their number formats.
_CONSOLE_FORMATS = {
  "train_loss": ".4f",
  "train_accuracy": ".4f",
  "learning_rate": ".3e",
  "tokens_per_sec": ".0f",
}


class ConsoleLog:
  """The one-line progress report: loss, learning rate, throughput and time left.

  Between the regular lines (every train.log_every_steps) it also prints short progress lines:
  after 1, 2, 4, 8, ... steps until the first regular line, so a slow run shows its speed and time
  left within its first steps, and then whenever PROGRESS_SECONDS pass without a line.
  """

  PROGRESS_SECONDS = 300.0

  def __init__(self, num_train_steps: int, *, log_every_steps: int = 0, enabled: bool = True):
    self._num_train_steps = num_train_steps
    self._log_every_steps = log_every_steps
    self._enabled = enabled
    self._last_time = None
    self._last_step = None
    self._first_step = None  # the step training started (or resumed) from
    self._last_line = None  # time of the last line printed

  def start(self, step: int) -> None:
    self._last_time, self._last_step = time.perf_counter(), step
    if self._first_step is None:
      self._first_step, self._last_line = step, self._last_time

  def rate(self, step: int) -> float:
    """Seconds per step since the last call (or start); restarts the interval."""
    now = time.perf_counter()
    seconds = (now - self._last_time) / max(step - self._last_step, 1)
    self._last_time, self._last_step = now, step
    return seconds

  def wants_progress(self, step: int) -> bool:
    """True if `step` (finished, not a regular logging step) deserves a progress line."""
    if not self._enabled or self._first_step is None or step <= self._last_step:
      return False
    every = self._log_every_steps
    if (every and step % every == 0) or step >= self._num_train_steps:
      return False  # the regular line follows
    done = step - self._first_step
    before_first_log = not every or step < (self._first_step // every + 1) * every
    if before_first_log and done & (done - 1) == 0:
      return True
    return time.perf_counter() - self._last_line >= self.PROGRESS_SECONDS

  def progress(self, step: int, scalars: dict[str, float]) -> None:
    """A progress line: the scalars so far, seconds per step and time left (the rate is kept)."""
    seconds_per_step = (time.perf_counter() - self._last_time) / max(step - self._last_step, 1)
    self.line(step, scalars, seconds_per_step, note=f"{seconds_per_step:.2f}s/step")

  def line(self, step: int, scalars: dict[str, float], seconds_per_step: float, note="") -> None:
    if not self._enabled:
      return
    self._last_line = time.perf_counter()
    left = format_duration((self._num_train_steps - step) * seconds_per_step)
    parts = [f"step {step}/{self._num_train_steps}"]
    for name, spec in _CONSOLE_FORMATS.items():
      if name in scalars:
        parts.append(f"{name} {scalars[name]:{spec}}")
    parts += [note] if note else []
    parts.append(f"{left} left")
    logging.info(", ".join(parts))
