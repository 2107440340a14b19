"""Trains a RoFormer-JAX model: `python train.py --config=configs/lm.py --workdir=DIR`.

The logic lives in roformer/train/ (loop.py drives a run).
"""

import os
import re
import sys
import sysconfig
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from roformer.infra import compile_cache

FLAGS = flags.FLAGS
_REPO = os.path.dirname(os.path.realpath(__file__))
config_flags.DEFINE_config_file(
  "config",
  None,
  "Training config file. `python -m roformer.posenc` lists the encodings and every posenc.* "
  "field with its default and doc (add --import=MODULE for an encoding of your own).",
  lock_config=True,
)
flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config.json).")
flags.DEFINE_string(
  "coordinator_address",
  os.environ.get("JAX_COORDINATOR_ADDRESS", ""),
  "HOST:PORT of process 0, for several processes (default $JAX_COORDINATOR_ADDRESS).",
)
flags.DEFINE_integer(
  "num_processes", int(os.environ.get("JAX_NUM_PROCESSES", "0")), "Number of processes."
)
flags.DEFINE_integer("process_id", int(os.environ.get("JAX_PROCESS_ID", "-1")), "This process.")
compile_cache.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


def _error(message: str) -> None:
  print(f"train.py: error: {message}", file=sys.stderr)
  sys.exit(1)


def _check_config_file(argv) -> None:
  """One line for a --config path that names no file (ml_collections would raise twice, later)."""
  path = _config_path(argv)
  if path is not None and not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    choices = sorted(
      f
      for f in (os.listdir(folder) if os.path.isdir(folder) else [])
      if f.endswith(".py") and not f.startswith("_")
    )
    hint = f"; {folder}/ has {', '.join(choices)}" if choices else ""
    _error(f"--config={path}: no such file{hint}")


def _without_traceback(message: str) -> str:
  """ml_collections reports an error raised by a config file's get_config (e.g. a missing
  `:ARG`) with its traceback; its last line says what is wrong: "flag --config=FILE: <that>"."""
  if "Traceback (most recent call last)" not in message:
    return message
  head = message.split(" Error whilst parsing config file", 1)[0]
  last = message.strip().splitlines()[-1]
  kind, _, text = last.partition(": ")
  # "ValueError: text" or "package.module.SomeError: text": the text alone.
  return f"{head} {text if text and kind.replace('.', '_').isidentifier() else last}"


# A config override of the wrong type, as absl words it ("flag --config.F=V: <its text>"), and
# the type the field takes.
_MISTYPED = {
  "invalid literal for int()": "an integer (e.g. 1000)",
  "could not convert string to float": "a number (e.g. 3e-4)",
  "Non-boolean argument to boolean flag": "a bool (true or false)",
}


def _mistyped_override(message: str) -> str | None:
  """One line for an override of the wrong type (`1e3` for an integer, `yes` for a bool),
  naming the field and its type, instead of Python's own wording; None for other errors."""
  kind = next((k for t, k in _MISTYPED.items() if t in message), None)
  if kind is None or not message.startswith("flag --config."):
    return None
  flag = message.removeprefix("flag ").split(": ", 1)[0]  # --config.GROUP.FIELD=VALUE
  name, _, value = flag.partition("=")
  return f"{flag}: {name.removeprefix('--config.')} takes {kind}, got {value!r}"


def _parse_flags(argv):
  """absl's flag parsing, with one clear line (no traceback) for a misspelt or mistyped field."""
  from roformer.infra import cpu_flags

  # Before the config file is loaded: it imports the model's packages (and JAX with them).
  cpu_flags.set_default_cpu_flags()
  _check_config_file(argv)
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _error(_mistyped_override(str(e)) or _without_traceback(str(e)))
  except SyntaxError as e:  # raised while ml_collections imports the config file
    where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
    _error(f"--config={e.filename}: {e.msg} ({where}): the config file is not valid Python")
  except (AttributeError, ImportError, KeyError, TypeError, ValueError) as e:
    text = " ".join(str(e).replace("\\n", " ").replace("\\'", "'").split()).strip("'\"")
    if (where := _raised_in_users_code(e)) is not None:  # the config file, or what it imports
      missing_module = isinstance(e, ModuleNotFoundError)
      hint = " (is it installed, or its directory on PYTHONPATH?)" if missing_module else ""
      _error(f"{where}: {type(e).__name__}: {' '.join(str(e).split())}{hint}")
    overrides = [a.split("=")[0][2:] for a in argv[1:] if a.startswith("--config.")]
    if isinstance(e, AttributeError | KeyError):  # ml_collections: an unknown name
      # 'Key "NAME" does not exist ...' (set in a config file) or 'NAME ...' (an override).
      m = re.match(r'Key "([^"]+)"', text)
      missing = m.group(1) if m else (text.split()[0].strip("'\"") if text else "")
      hint = text[text.find("Did you mean") :].rstrip("'\"") if "Did you mean" in text else ""
      hint = f"; {hint}" if hint else ""
      for override in overrides:
        parts = override.split(".")[1:]  # config.GROUP.FIELD -> [GROUP, FIELD]
        if missing in parts:
          kind = "group" if parts.index(missing) == 0 and len(parts) > 1 else "field"
          name = ".".join(parts[: parts.index(missing) + 1])
          _error(f"--{override}: {name} is not a config {kind}{hint}")
      group = _group_listed(text)
      if group == "posenc" and not hint:
        hint += (
          "; an encoding's own fields exist once the module that registers it is imported: "
          "import it in the config file (docs/extending.md)"
        )
      if group == "":  # the top level: a group's name
        what = f"{missing} is not a config group"
      else:
        what = f"{f'{group}.' if group else ''}{missing or text} is not a config field"
      _error(f"--config={_config_path(argv)}: {what}{hint}")
    culprit = next((o for o in overrides if o.rsplit(".", 1)[-1] in text), "config")
    _error(f"--{culprit}: {text}")


def _config_path(argv) -> str | None:
  """The --config file of the command line (without its :ARG), None without one."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1].split(":", 1)[0]
    if arg.startswith("--config="):
      return arg.split("=", 1)[1].split(":", 1)[0]
  return None


def _raised_in_users_code(e: Exception) -> str | None:
  """ "FILE, line N (source)" of the user's code that raised `e` (a mistake in the config file or
  in a module of the user's it imports: the innermost frame outside the libraries), or None when
  ml_collections or this project raised it (a config error, reported as such)."""
  frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
  if not frames:  # e.g. raised inside importlib itself
    return None

  def under(frame, *folders) -> bool:
    return any(folder in os.path.realpath(frame.filename) for folder in folders)

  if under(frames[-1], os.path.join(_REPO, "roformer") + os.sep, f"{os.sep}ml_collections{os.sep}"):
    return None
  libraries = (sysconfig.get_paths()["stdlib"] + os.sep, "-packages" + os.sep)
  users = [f for f in frames if not under(f, *libraries, os.path.realpath(__file__))]
  frame = users[-1] if users else frames[-1]
  return f"{frame.filename}, line {frame.lineno}" + (f" ({frame.line})" if frame.line else "")


def _group_listed(text: str) -> str | None:
  """The config group (dotted; "" for the top level) whose fields ml_collections lists after an
  unknown name ("Other fields present: {...}"): the ConfigDict of configs/default.py whose
  fields are most nearly those."""
  listed = set(re.findall(r"'(\w+)': ", text.partition("Other fields present")[2]))
  if not listed:
    return None
  from configs import default

  nodes = {}

  def walk(node, path):
    nodes[path] = set(node.keys())
    for key in node.keys():
      if hasattr(node[key], "keys"):
        walk(node[key], f"{path}.{key}" if path else key)

  walk(default.get_config(), "")
  score = {path: len(listed & keys) / len(listed | keys) for path, keys in nodes.items()}
  best = max(score, key=score.get)
  return best if score[best] > 0 else None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  import jax

  if FLAGS.coordinator_address:
    # CPU processes exchange collectives over gloo; TPU and GPU use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes or None,
      process_id=FLAGS.process_id if FLAGS.process_id >= 0 else None,
    )
  elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
    jax.distributed.initialize()  # a TPU pod slice: JAX finds its peers itself

  from roformer import config as config_lib
  from roformer import errors
  from roformer.data.sources.base import cache_root

  compile_cache.enable_from_flags(FLAGS, cache_root(FLAGS.config.data))  # before any compile
  from roformer.infra import checkpoint, metrics_log, workdir
  from roformer.train import loop as train_loop

  metrics_log.quiet_library_logs()
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)  # process 0 speaks for all

  logging.info(
    "JAX process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices()
  )
  try:
    train_loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (
    config_lib.ConfigError,
    workdir.WorkdirError,
    errors.NonFiniteLossError,
    checkpoint.CheckpointNotFoundError,
  ) as e:
    _error(str(e))
  except errors.StorageFullError as e:
    sys.stdout.flush()
    print(f"train.py: error: {e.strerror}", file=sys.stderr, flush=True)
    # Every writer still holding data fails too (TensorBoard's, at exit and in its thread), each
    # with its traceback: leave at once (the lock goes with the process; nothing more fits).
    os._exit(1)
  except errors.RunInterrupted as e:  # saved: the loop said so; the status says interrupted
    sys.exit(e.exit_status)
  except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
    print("train.py: interrupted; nothing was saved since the last checkpoint", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
