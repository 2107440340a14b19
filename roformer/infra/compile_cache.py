"""JAX's persistent compilation cache for the command-line tools: XLA's compiled programs kept on
disk, so the next start of the same program (a resumed run, a rerun, another run of the same
shapes, an evaluation at the same lengths) loads it instead of compiling it again.

train.py, eval.py and generate.py define the flags with `define_flags` and call `enable_from_flags`
before anything compiles.
"""

from __future__ import annotations

import os

from absl import flags

# Programs that compile faster than this are not written. On a 2-core CPU, train.py's start-up
# for a 12-layer, 768-wide decoder compiles three: the initialiser (15 s), the train step (11 s)
# and a 0.04 s conversion. Half JAX's default of 1 s keeps a smaller model's or a faster
# machine's programs too, and still leaves the tiny ones out.
MIN_COMPILE_SECONDS = 0.5
# Where under the cache root (`roformer.data.sources.base.cache_root`: data.cache_dir, else
# $ROFORMER_CACHE, else ~/.cache/roformer) the programs go: beside the token cache's "tokens".
SUBDIR = "xla"


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """--compilation_cache_dir=DIR and --[no]compilation_cache (on absl's global flags)."""
  flags.DEFINE_string(
    "compilation_cache_dir",
    "",
    "Directory of JAX's persistent compilation cache (compiled programs reused by the next "
    "start); default: xla/ beside the token cache, under $ROFORMER_CACHE, else "
    "~/.cache/roformer (train.py: under data.cache_dir when set).",
    flag_values=flag_values,
  )
  flags.DEFINE_bool(
    "compilation_cache",
    True,
    "Keep compiled programs on disk and reuse them (--nocompilation_cache: compile everything, "
    "write nothing).",
    flag_values=flag_values,
  )


def enable(directory: str) -> str:
  """Turns JAX's persistent compilation cache on, in `directory` (created if missing).

  Must run before the first compilation: JAX opens the cache once, at the first compile. Only
  process 0 of a multi-process run writes entries (JAX's rule); every process reads them.

  Returns:
    The absolute directory.
  """
  import jax

  directory = os.path.abspath(os.path.expanduser(directory))
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)  # any size
  return directory


def enable_from_flags(values: flags.FlagValues, cache_root: str) -> str | None:
  """`enable` as the flags say: in --compilation_cache_dir, else $JAX_COMPILATION_CACHE_DIR, else
  `cache_root`/xla.

  With --nocompilation_cache the cache is off, also where $JAX_COMPILATION_CACHE_DIR would
  turn it on, and None is returned.
  """
  if not values.compilation_cache:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    return None
  directory = values.compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
  return enable(directory or os.path.join(cache_root, SUBDIR))
