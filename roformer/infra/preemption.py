"""Stopping on a signal: SIGTERM (a TPU preemption, `kill`) and Ctrl-C become a flag that the
training loop reads at step boundaries, agreed on by every process of a multi-host run."""

import signal
import threading

import jax
import numpy as np


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


def stop_requested(watcher: PreemptionWatcher, train, done: int) -> bool:
  """True when a signal asked to stop; several processes agree on it at logging steps only."""
  stop = watcher.requested()
  if jax.process_count() > 1:
    # One collective per logging interval; every process then stops at the same step.
    stop = done % train.log_every_steps == 0 and any_process(stop)
  return stop


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (all processes stop at the same step)."""
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.array([flag], np.int32))
  return bool(np.max(flags))


def sync_processes(name: str) -> None:
  """Waits until every process reaches the barrier `name`."""
  from jax.experimental import multihost_utils

  multihost_utils.sync_global_devices(name)
