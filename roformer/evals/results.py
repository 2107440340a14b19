"""Result JSONs of the evaluation drivers: written through epath (so gs:// works), and the step
an existing one was made at, for the message that refuses to overwrite it."""

import json

from etils import epath


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
