"""Background preparation of the next training batches, off the train step's critical path."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

_DONE = object()


class Prefetcher:
  """Iterates `make(step)` over `steps`, computed `depth` steps ahead on a daemon thread.

  The host work of a batch (reading windows, MLM masking, placing it on the devices) then runs
  while the devices execute earlier steps. Batches come out in `steps` order; an exception in
  `make` is re-raised by the iterator at that step. Use as a context manager so the thread stops
  when the loop ends early.
  """

  def __init__(self, make: Callable[[int], Any], steps: Iterable[int], *, depth: int = 2):
    if depth < 1:
      raise ValueError(f"depth={depth} must be >= 1")
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._fill, args=(make, steps), daemon=True)
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _fill(self, make, steps) -> None:
    try:
      for step in steps:
        if not self._put((step, make(step), None)):
          return
    except Exception as e:  # handed to the consumer, raised at the step that failed
      self._put((None, None, e))
      return
    self._put(_DONE)

  def __iter__(self):
    return self

  def __next__(self):
    item = self._queue.get()
    if item is _DONE:
      self._queue.put(_DONE)  # later calls stop too
      raise StopIteration
    step, batch, error = item
    if error is not None:
      raise error
    return step, batch

  def close(self) -> None:
    self._stop.set()
    self._thread.join()

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
