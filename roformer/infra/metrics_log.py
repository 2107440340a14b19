"""Training metrics: DIR/metrics.jsonl, TensorBoard scalars in DIR, and console lines.

Only process 0 writes; on other processes every method does nothing.
"""

import contextlib
import errno
import json
import logging as logging_std
import math
import os
import sys
import time
from typing import Any

import jax
from absl import logging
from etils import epath

from roformer.errors import StorageFullError, is_disk_full

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
    if self._path.exists():
      self._repair_last_line()
    self._tb = _import_tensorboardx().SummaryWriter(logdir=str(workdir))

  def _repair_last_line(self) -> None:
    """Cuts off a last line that a crash left unfinished (not one JSON object), so the next record
    starts a line of its own instead of joining it into one unreadable line. A whole record that
    only lacks its newline gets it."""
    data = self._path.read_bytes()
    keep = _whole_lines_length(data)
    repaired = data[:keep]
    if keep < len(data) and _is_record(data[keep:]):
      repaired = data + b"\n"
    elif keep < len(data):
      logging.warning(
        "%s: dropped %d bytes at its end, a record left unfinished when a run stopped (%r).",
        self._path,
        len(data) - keep,
        data[keep : keep + 60],
      )
    if self._rewrite:
      self._text = repaired.decode("utf-8", errors="replace")
    if repaired == data:
      return
    if self._rewrite:
      self._path.write_text(self._text)
    elif len(repaired) < len(data):
      os.truncate(self._path, len(repaired))
    else:
      with self._path.open("ab") as f:
        f.write(b"\n")

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Writes {"step": step, **scalars} as one line, and each scalar to TensorBoard.

    Raises:
      StorageFullError (one line) when the disk is full.
    """
    if not self._enabled:
      return
    record = {"step": int(step), **{k: _clean(float(v)) for k, v in scalars.items()}}
    line = json.dumps(record) + "\n"
    with self._disk_full_in_one_line():
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
      tb, self._tb = self._tb, None
      with self._disk_full_in_one_line():
        tb.close()

  @contextlib.contextmanager
  def _disk_full_in_one_line(self):
    try:
      yield
    except OSError as e:
      if not is_disk_full(e):
        raise
      raise StorageFullError(
        errno.ENOSPC,
        f"cannot write the metrics in {self._path.parent}: the disk is full (no space left on "
        "device): free some space, then rerun to resume from the last checkpoint",
      ) from None


def _is_record(line: bytes) -> bool:
  try:
    return isinstance(json.loads(line), dict)
  except ValueError:  # undecodable bytes (UnicodeDecodeError is a ValueError) or cut JSON
    return False


def _whole_lines_length(data: bytes) -> int:
  """The length of `data` up to the end of its last whole record: a line that ends in a newline
  and decodes as one JSON object."""
  whole = data[: data.rfind(b"\n") + 1]  # b"" when no line is finished
  if not whole:
    return 0
  start = whole.rfind(b"\n", 0, len(whole) - 1) + 1
  return len(whole) if _is_record(whole[start:]) else start


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
