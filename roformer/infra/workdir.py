"""The run directory: its path resolved once at the boundary, and the lock one training run holds.

A local workdir is locked with `fcntl.flock` on DIR/.lock. The kernel releases the lock when the
process ends, however it ends (SIGKILL included), so a crashed run never leaves a stale lock; the
file only records who held it last, for the message a second run prints. Object-store workdirs
(gs://...) cannot be locked this way: there the scheduler must give each job its own workdir.
"""

import datetime
import fcntl
import json
import os
import socket

from absl import logging
from etils import epath

from roformer.errors import WorkdirError

LOCK_FILE = ".lock"


def is_remote(path: str | epath.Path) -> bool:
  """True for object-store paths (gs://, s3://, ...), which have no local file locks."""
  return "://" in str(path)


def resolve(path: str, *, flag: str = "--workdir") -> str:
  """`path` as an absolute local path (`~` expanded), or unchanged when it is remote.

  Relative paths are resolved against the current directory here, once, because Orbax and the
  asynchronous checkpoint writer need absolute paths.

  Raises:
    WorkdirError naming `flag` when the path is empty.
  """
  if not path.strip():
    raise WorkdirError(f"{flag} is empty: give the run's directory, e.g. {flag}=runs/my_run")
  if is_remote(path):
    return path
  return os.path.abspath(os.path.expanduser(path))


def make_writable(workdir: str, *, flag: str = "--workdir") -> None:
  """Creates the workdir if needed; WorkdirError (one line) if it cannot be created or written."""
  try:
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"{flag}={workdir}: cannot create it ({e.strerror or e})") from None
  if not is_remote(workdir) and not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"{flag}={workdir}: the directory is not writable")


class WorkdirLock:
  """An exclusive lock on a local workdir, held from `acquire` until `release` or process exit."""

  def __init__(self, workdir: str, *, flag: str = "--workdir"):
    self._workdir, self._flag = workdir, flag
    self._file = None

  def acquire(self) -> None:
    """Takes the lock without waiting; WorkdirError naming the holder if another run has it."""
    if is_remote(self._workdir):
      logging.warning(
        "%s=%s is not a local directory: nothing stops a second run from writing into it.",
        self._flag,
        self._workdir,
      )
      return
    path = os.path.join(self._workdir, LOCK_FILE)
    try:
      # "a+" neither truncates nor changes the holder's record when the lock is refused.
      lock_file = open(path, "a+")  # noqa: SIM115  (held open for the lock's lifetime)
    except OSError as e:
      raise WorkdirError(f"{self._flag}={self._workdir}: cannot write {path} ({e.strerror})") from e
    try:
      fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      lock_file.seek(0)
      holder = lock_file.read().strip() or "another process"
      lock_file.close()
      raise WorkdirError(
        f"{self._flag}={self._workdir} is in use by another training run ({holder}); wait for "
        f"it to finish, or give this run another {self._flag}"
      ) from None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
    lock_file.flush()
    self._file = lock_file

  def release(self) -> None:
    if self._file is not None:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()
    return False


# The run's resolved config, written by roformer.config when the run starts.
CONFIG_FILE = "config.json"
# Files of a run that a replacing config makes stale (checkpoints/ is empty when this is used).
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "tokenizer.json", "eval")
REPLACED_DIR = "replaced"


def archive_run_files(workdir: str) -> str:
  """Moves an earlier attempt's files into DIR/replaced/<time>/; returns that directory."""
  root = epath.Path(workdir)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  target = root / REPLACED_DIR / stamp
  target.mkdir(parents=True, exist_ok=True)
  names = [n for n in RUN_FILES if (root / n).exists()]
  names += [p.name for p in root.glob("events.out.tfevents.*")]
  for name in names:
    (root / name).rename(target / name)
  return str(target)


def read_config_json(workdir: str | epath.Path) -> dict | None:
  """DIR/config.json as a plain dict, or None when the workdir has none; WorkdirError naming the
  file when it is not JSON (a write cut short).

  The one reader of the file: roformer.config builds the RunConfig from this dict, and the plots
  (evals/plots.py) read the training length from it here, since importing roformer.config imports
  the model and JAX, which drawing existing results (eval.py --compare) does not need.
  """
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise WorkdirError(f"{path} is not valid JSON ({e})") from None
