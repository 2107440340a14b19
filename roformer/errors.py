"""The exception types a user sees: each says which input, file or setting is at fault.

The CLIs turn these into one line and a non-zero exit; anything else is a bug and keeps its
traceback."""

import errno
import signal


class ConfigError(ValueError):
  """A configuration value is missing, misspelt, of the wrong type or out of range."""


class DataError(ValueError):
  """Bad data configuration or input; the message names the config field or path at fault."""


class WorkdirError(ValueError):
  """The workdir is empty, cannot be created or written, or another run holds it."""


class CheckpointNotFoundError(FileNotFoundError):
  """The workdir has no finished checkpoint that reads back (or not the step asked for)."""


class StorageFullError(OSError):
  """A write failed because the disk (or the user's quota) is full."""


# A write refused for lack of space, or of the user's quota.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException | None) -> bool:
  """True when `error`, or an error it chains, is a write refused by a full disk: an OSError from
  Python, or TensorStore's error (a ValueError) quoting the OS error code."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
      return True
    if any(f"[os_error_code='{code}']" in str(error) for code in _DISK_FULL_ERRNOS):
      return True
    error = error.__cause__ or error.__context__
  return False


class NonFiniteLossError(RuntimeError):
  """Training produced a NaN or infinite loss or gradient."""


class RunInterrupted(Exception):
  """A signal (SIGTERM, SIGINT) stopped training at a step boundary, after it saved a checkpoint.

  `exit_status` is the shell's status of a process the signal ended: 128 + its number (130 for
  SIGINT, 143 for SIGTERM), so a script or scheduler can tell an interrupted run from a finished
  one.
  """

  def __init__(self, signal_name: str, step: int):
    self.signal_name, self.step = signal_name, step
    self.exit_status = 128 + int(signal.Signals[signal_name])
    super().__init__(f"{signal_name} received: saved the checkpoint of step {step}")
