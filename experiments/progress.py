"""A grid's progress and its stops: one line per run with an ETA, reports rewritten at most once
a minute, and Ctrl-C as one line naming the finished runs."""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time
from collections.abc import Callable

# A grid rewrites its tables and plots after each finished run, so that a grid stopped part-way
# leaves the summaries of the runs it finished; drawing them takes seconds, as long as a smoke
# grid's whole run, so runs that finish faster than this share one rewrite. On an exception
# (Ctrl-C, a signal, an error) the pending rewrite is made; after the last run the drivers write
# their report themselves.
REPORT_EVERY_SECONDS = 60.0


class ThrottledReport:
  """`report(*args)` after a finished run, at most once per REPORT_EVERY_SECONDS (the first at
  once); `flush()` makes the one left pending."""

  def __init__(self, report: Callable, every: float = REPORT_EVERY_SECONDS):
    self.report, self.every, self.last, self.pending = report, every, -float("inf"), None

  def __call__(self, *args) -> None:
    self.pending = args
    if time.monotonic() - self.last >= self.every:
      self.flush()

  def flush(self) -> None:
    if self.pending is not None:
      args, self.pending = self.pending, None
      self.report(*args)
      self.last = time.monotonic()

  @contextlib.contextmanager
  def flushed_on_error(self):
    try:
      yield self
    except BaseException:
      self.flush()
      raise


class Progress:
  """One line per run: which run, elapsed time, and the grid's ETA from the runs done so far."""

  def __init__(self, total: int):
    self.total, self.start, self.done_seconds, self.done = total, time.time(), 0.0, 0

  def begin(self, index: int, name: str, what: str) -> float:
    eta = ""
    if self.done:
      remaining = (self.total - index + 1) * self.done_seconds / self.done
      eta = f", grid ETA {remaining / 60:.0f} min"
    elapsed = (time.time() - self.start) / 60
    print(f"[{index}/{self.total}] {name}: {what} ({elapsed:.0f} min elapsed{eta})", flush=True)
    return time.time()

  def end(self, started: float) -> None:
    self.done += 1
    self.done_seconds += time.time() - started


@contextlib.contextmanager
def stop_on_ctrl_c(out: pathlib.Path):
  """Ctrl-C: one line saying which runs are finished (their JSONs) and how to resume, exit 130."""
  try:
    yield
  except KeyboardInterrupt:
    done = sorted(p.stem for p in pathlib.Path(out).glob("*.json"))
    print(
      f"interrupted; {len(done)} finished runs in {out}"
      + (f" ({', '.join(done)})" if done else "")
      + "; rerun the same command to resume",
      file=sys.stderr,
    )
    sys.exit(130)
