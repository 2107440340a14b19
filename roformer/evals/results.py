"""Result JSONs of the evaluation drivers: where they go (DIR/eval/ or --out_dir), checked
writable before any work, written through epath (so gs:// works), and the step an existing one
was made at, for the message that refuses to overwrite it."""

import json
import os

from etils import epath

from roformer.errors import WorkdirError
from roformer.infra import workdir as workdir_lib


def output_dir(workdir, out_dir: str = "") -> epath.Path:
  """The directory of an evaluation's NAME.json and NAME.png: `out_dir`, else WORKDIR/eval."""
  if out_dir:
    return epath.Path(workdir_lib.resolve(out_dir, flag="--out_dir"))
  return epath.Path(workdir) / "eval"


def check_writable(directory: epath.Path, *, out_dir: str = "") -> None:
  """Raises WorkdirError (one line) if `directory` cannot be created or written.

  Called before the model is loaded: results are written once every length is scored, and a
  failure then would lose all of that work. Remote paths (gs://) are left to the write.
  """
  if workdir_lib.is_remote(directory):
    return
  existing = os.fspath(directory)
  while not os.path.exists(existing):  # the nearest ancestor that exists is the one created in
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    reason = f"{existing} is not a directory"
  elif not os.access(existing, os.W_OK | os.X_OK):
    reason = f"{existing} is not writable"
  else:
    return
  if out_dir:
    raise WorkdirError(f"--out_dir={out_dir}: cannot write the results there ({reason})")
  raise WorkdirError(
    f"cannot write the results to {directory} ({reason}); give --out_dir=DIR to write them "
    "elsewhere"
  )


def step_of(json_path: epath.Path) -> str:
  try:
    return f" (step {json.loads(json_path.read_text())['step']})"
  except (ValueError, KeyError, TypeError):
    return ""


def write_result(result: dict, path) -> epath.Path:
  """Writes an eval JSON (through epath, so gs:// works)."""
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=2) + "\n")
  return path
