"""The persistent compilation cache of the command-line tools (roformer/infra/compile_cache.py):
a second process finds the first one's programs; --nocompilation_cache writes none."""

import json
import os
import subprocess
import sys

# One process of a CLI: its flags, the cache enabled from them, then one compilation. Programs
# this small compile in milliseconds, under MIN_COMPILE_SECONDS: the threshold is lowered after
# `enable_from_flags`, so that they are written at all.
_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from absl import flags
from roformer.infra import compile_cache

values = flags.FlagValues()
compile_cache.define_flags(values)
values(["cli", *sys.argv[2:]])
directory = compile_cache.enable_from_flags(values, cache_root=sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({"dir": directory, "hits": events.count("/jax/compilation_cache/cache_hits")}))
"""


def _cli(root, *args, jax_dir: str = "") -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update({"JAX_COMPILATION_CACHE_DIR": jax_dir} if jax_dir else {})
  done = subprocess.run(
    [sys.executable, "-c", _SCRIPT, str(root), *args],
    capture_output=True, text=True, timeout=120, env={**env, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1])


def _entries(directory) -> set[str]:
  return {name for name in os.listdir(directory) if not name.startswith(".")}


def test_compilation_cache_second_process_loads_the_first_ones_programs(tmp_path):
  first = _cli(tmp_path)
  assert first["dir"] == str(tmp_path / "xla")  # beside the token cache's tokens/
  written = _entries(first["dir"])
  assert written and first["hits"] == 0
  second = _cli(tmp_path)
  assert second["hits"] >= 1  # the program came from the disk, not from XLA
  assert _entries(second["dir"]) == written  # and nothing new was compiled and written


def test_compilation_cache_dir_flag_moves_it(tmp_path):
  got = _cli(tmp_path / "root", f"--compilation_cache_dir={tmp_path / 'elsewhere'}")
  assert got["dir"] == str(tmp_path / "elsewhere") and _entries(got["dir"])
  assert not (tmp_path / "root").exists()


def test_nocompilation_cache_writes_nothing(tmp_path, monkeypatch):
  # Even where JAX's own environment variable names a directory.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  env_cache = tmp_path / "env"
  done = subprocess.run(
    [sys.executable, "-c", _SCRIPT, str(tmp_path / "root"), "--nocompilation_cache"],
    capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout.strip().splitlines()[-1]) == {"dir": None, "hits": 0}
  assert not (tmp_path / "root").exists()
  assert not env_cache.exists() or not _entries(env_cache)


def test_jax_compilation_cache_dir_is_used_when_no_flag_names_a_directory(tmp_path):
  got = _cli(tmp_path / "root", jax_dir=str(tmp_path / "env"))
  assert got["dir"] == str(tmp_path / "env") and _entries(got["dir"])
  assert not (tmp_path / "root").exists()
  flag = _cli(tmp_path / "root", f"--compilation_cache_dir={tmp_path / 'flag'}", jax_dir="x")
  assert flag["dir"] == str(tmp_path / "flag")  # the flag first
