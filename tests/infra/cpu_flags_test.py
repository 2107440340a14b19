"""roformer/infra/cpu_flags.py: default XLA:CPU flags only on CPU, only when the user set none;
there freed memory is kept for reuse."""

import importlib.util
import os
import platform
import subprocess
import sys

import pytest

from roformer.infra import cpu_flags
from roformer.testing import REPO


@pytest.mark.parametrize(
  "env, expected",
  [
    ({"JAX_PLATFORMS": "cpu"}, cpu_flags.CPU_XLA_FLAGS),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}, "--xla_dump_to=/tmp/x"),
    ({"JAX_PLATFORMS": "tpu"}, None),
    ({"JAX_PLATFORMS": "cuda,cpu"}, None),
  ],
)
def test_cpu_flags_set_only_on_cpu_without_user_flags(monkeypatch, env, expected):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setattr(cpu_flags, "keep_freed_host_memory", lambda: True)  # not this process
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  assert cpu_flags.set_default_cpu_flags() == (
    expected == cpu_flags.CPU_XLA_FLAGS and "XLA_FLAGS" not in env
  )
  assert os.environ.get("XLA_FLAGS") == expected


# After the CPU flags are set (as train.py sets them), a thread allocates, fills and frees N bytes
# (argv[1]) twice, as XLA:CPU's threads do a program's temporary buffer on each execution; it
# prints the page faults of the second fill.
_REALLOCATE = """
import ctypes, resource, sys, threading
libc = ctypes.CDLL(None)
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, as where huge pages are opt-in
from roformer.infra import cpu_flags
cpu_flags.set_default_cpu_flags()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
n = int(sys.argv[1])
def fill():
  p = libc.malloc(n)
  ctypes.memset(p, 1, n)
  libc.free(ctypes.c_void_p(p))
def run():
  fill()
  before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
  fill()
  print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=run)
t.start()
t.join()
"""


@pytest.mark.skipif(
  platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
@pytest.mark.parametrize(
  "platforms, size, kept",
  [
    ("cpu", 64 << 20, True),
    ("tpu", 64 << 20, False),
    # Past 2 GiB, the most an int trim threshold can say: freed, it is still not trimmed.
    ("cpu", 2304 << 20, True),
  ],
  ids=["cpu-64MiB", "tpu-64MiB", "cpu-2.25GiB"],
)
def test_on_cpu_freed_memory_is_reused_without_page_faults(platforms, size, kept):
  env = {k: v for k, v in os.environ.items() if k not in cpu_flags._MALLOC_ENV}
  proc = subprocess.run(
    [sys.executable, "-c", _REALLOCATE, str(size)],
    env=dict(env, JAX_PLATFORMS=platforms, PYTHONPATH=str(REPO)),
    capture_output=True, text=True, timeout=120, check=True,
  )  # fmt: skip
  faults = proc.stdout.strip()
  pages = size // 4096
  # Without the setting the second buffer is a fresh mmap: a fault for each of its pages.
  assert (int(faults) < pages // 100) if kept else (int(faults) >= pages // 2), faults


def test_user_malloc_settings_win(monkeypatch):
  monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
  assert not cpu_flags.keep_freed_host_memory()


@pytest.mark.parametrize("attached", [False, True])
def test_libtpu_without_a_tpu_chip_counts_as_cpu_only(monkeypatch, attached):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
  # set_default_cpu_flags may set XLA_FLAGS: monkeypatch puts the variable back afterwards.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  monkeypatch.setattr(cpu_flags, "keep_freed_host_memory", lambda: True)  # not this process
  installed = {"libtpu"}
  monkeypatch.setattr(
    cpu_flags.importlib.util, "find_spec", lambda name: object() if name in installed else None
  )
  monkeypatch.setattr(cpu_flags, "tpu_attached", lambda: attached)
  assert cpu_flags.runs_on_cpu_only() is not attached
  cpu_flags.set_default_cpu_flags()
  # Only where no chip is attached does JAX skip libtpu; where one is, JAX probes and reports.
  assert os.environ.get("JAX_PLATFORMS") == (None if attached else "cpu")
  monkeypatch.setenv("JAX_FORCE_TPU_INIT", "1")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  assert not cpu_flags.runs_on_cpu_only()


def test_tpu_attached_is_jax_probe():
  from jax._src import hardware_utils

  chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  assert cpu_flags.tpu_attached() == (chips > 0)


_START_JAX = """
from roformer.infra import cpu_flags
cpu_flags.set_default_cpu_flags(keep_freed_memory=False)
import jax
print(jax.devices()[0].platform)
"""


def _start_jax_as_a_cli_does() -> str:
  """stderr of a process that starts JAX as the CLIs do, with JAX_PLATFORMS and XLA_FLAGS unset;
  asserts that it ran on the CPU."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  proc = subprocess.run(
    [sys.executable, "-c", _START_JAX],
    env=dict(env, PYTHONPATH=str(REPO)),
    capture_output=True, text=True, timeout=120, check=True,
  )  # fmt: skip
  assert proc.stdout.strip() == "cpu"
  return proc.stderr


@pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None or cpu_flags.tpu_attached(),
  reason="needs libtpu installed (jax[tpu]) on a machine without a TPU chip",
)
def test_jax_tpu_installed_on_a_cpu_machine_starts_without_tpu_lines():
  stderr = _start_jax_as_a_cli_does()
  assert "tpu" not in stderr.lower(), stderr[-2000:]


@pytest.mark.skipif(
  importlib.util.find_spec("jax_cuda13_plugin") is None or cpu_flags.gpu_attached(),
  reason="needs JAX's CUDA plugin installed on a machine without an NVIDIA GPU",
)
def test_a_cuda_plugin_installed_on_a_machine_without_a_gpu_starts_on_the_cpu_quietly():
  stderr = _start_jax_as_a_cli_does()
  assert "cuda" not in stderr.lower() and "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("files, attached", [
  ({"/dev": ["null", "nvidiactl"]}, False),
  ({"/dev": ["nvidiactl", "nvidia0"]}, True),
  ({"/dev": ["null"], "/proc/driver/nvidia/gpus": ["0000:01:00.0"]}, True),  # before modprobe
  ({"/dev": ["dxg"]}, True),  # WSL2
])  # fmt: skip
def test_a_cuda_plugin_without_a_gpu_is_cpu_only(monkeypatch, files, attached):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(
    cpu_flags.importlib.util, "find_spec",
    lambda name: object() if name == "jax_cuda13_plugin" else None,
  )  # fmt: skip
  monkeypatch.setattr(cpu_flags, "_listdir", lambda path: files.get(path, []))
  assert cpu_flags.gpu_attached() is attached
  assert cpu_flags.runs_on_cpu_only() is not attached
