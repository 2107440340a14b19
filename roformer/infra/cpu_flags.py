"""XLA:CPU flags and the CPU platform for training and evaluation, set before JAX starts (this
module imports no JAX)."""

import ctypes
import importlib.util
import os
import pathlib
import platform
import sys

# XLA:CPU's experimental YNNPACK fusions slow this project's train step down (about 13% on a
# 4-layer, 256-wide encoder); an empty fusion-type list turns them off.
CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type="
# Installed plugins that give JAX a non-CPU default backend.
_ACCELERATOR_MODULES = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def runs_on_cpu_only() -> bool:
  """True when JAX will use only the CPU: JAX_PLATFORMS=cpu, or unset with no accelerator plugin
  that has its hardware here (libtpu without a TPU chip, a CUDA plugin without an NVIDIA GPU
  count as none)."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.strip().lower() == "cpu"
  for name in _ACCELERATOR_MODULES:
    if importlib.util.find_spec(name) is None:
      continue
    if name == "libtpu":
      if "JAX_FORCE_TPU_INIT" in os.environ or tpu_attached():
        return False
    elif gpu_attached(rocm=name.startswith("jax_rocm")):
      return False
  return True


def gpu_attached(rocm: bool = False) -> bool:
  """Whether this machine shows an NVIDIA GPU (or, with `rocm`, an AMD one: /dev/kfd): a device
  file /dev/nvidia0, ..., a GPU the loaded driver lists in /proc/driver/nvidia/gpus (its device
  files may be made only at the first CUDA call), or WSL2's /dev/dxg. A CUDA plugin installed
  without one (to compile for GPUs, benchmarks/gpu_targets.py) would otherwise fail to start
  with a traceback in every run."""
  if rocm:
    return os.path.exists("/dev/kfd")
  devices = _listdir("/dev")
  return (
    any(n.startswith("nvidia") and n[len("nvidia") :].isdigit() for n in devices)
    or "dxg" in devices
    or bool(_listdir("/proc/driver/nvidia/gpus"))
  )


def _listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except OSError:
    return []


def tpu_attached() -> bool:
  """Whether a TPU chip is on this machine's PCI bus, by JAX's own probe (the one that decides
  its Cloud TPU set-up: jax/_src/hardware_utils.py, loaded without importing JAX). True when
  that probe cannot be read: then JAX probes for itself."""
  jax_spec = importlib.util.find_spec("jax")
  if jax_spec is None or not jax_spec.submodule_search_locations:
    return True
  path = pathlib.Path(list(jax_spec.submodule_search_locations)[0]) / "_src" / "hardware_utils.py"
  try:
    spec = importlib.util.spec_from_file_location("_jax_hardware_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    chips, _ = module.num_available_tpu_chips_and_device_id()
  except Exception:  # another JAX's layout: leave the probe to JAX
    return True
  return chips > 0


def set_default_cpu_flags(keep_freed_memory: bool = True) -> bool:
  """On a machine where JAX runs on CPU only: sets XLA_FLAGS to CPU_XLA_FLAGS if the user set
  none, keeps freed memory in the process (`keep_freed_host_memory`, unless `keep_freed_memory`
  is False), and with JAX_PLATFORMS unset sets it to "cpu".

  The last because JAX otherwise loads an installed libtpu (`jax[tpu]`) on any machine, and on
  one without a TPU chip its failure prints libtpu's warnings and "Unable to initialize backend
  'tpu'" in every run (a CUDA plugin without a GPU, its traceback); where a chip is attached
  (or JAX_FORCE_TPU_INIT is set) JAX probes as always, so a TPU that fails to start still says
  why.

  Must run before JAX initialises its backends. Returns True when it set XLA_FLAGS.
  """
  if not runs_on_cpu_only():
    return False
  if keep_freed_memory:
    keep_freed_host_memory()
  if not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # JAX read the variable when it was imported
      sys.modules["jax"].config.update("jax_platforms", "cpu")
  if "XLA_FLAGS" in os.environ:
    return False
  os.environ["XLA_FLAGS"] = CPU_XLA_FLAGS
  return True


# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# The environment variables through which a user tunes glibc's malloc: set, they win.
_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
# Whether keep_freed_host_memory changed this process's settings (mallopt has no getter).
_kept = False


def keep_freed_host_memory() -> bool:
  """Makes glibc's malloc keep the memory a program frees for its next allocations, instead of
  returning it to the kernel. Returns True when it changed the settings.

  Each execution of a compiled program allocates XLA:CPU's temporary buffer (304 MiB for the
  train step of docs/performance.md's 4-layer decoder) and frees it at the end. glibc gives an
  allocation over 32 MiB a fresh mmap and unmaps it when freed, so every step the kernel maps
  and zeroes it again, page by page: 80,000 page faults and 0.17 s of system time per step
  there. Without mmap (M_MMAP_MAX 0) an allocation comes from an arena's heap, but a thread's
  own arena holds at most 64 MiB and still maps larger ones; so one arena, the main one, which
  grows without bound, and no trimming of its top at all (M_TRIM_THRESHOLD -1; the largest
  positive threshold, 2 GiB, is passed when a few steps are in flight: docs/performance.md's MLM
  encoder holds 2.4 GiB of them and was trimmed every few steps): the freed buffer stays in the
  heap and the next step reuses it. The process keeps its peak memory, and all threads share
  one arena's lock (measured on 2-core machines only).

  Must run before the threads that allocate start: a thread picks its arena at its first
  allocation (and an arena a finished thread left behind is reused whatever the limit). Linux
  with glibc only, and only if the user tunes malloc in none of `_MALLOC_ENV`.
  """
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  if any(name in os.environ for name in _MALLOC_ENV):
    return False
  libc = ctypes.CDLL(None)
  # Each call returns 1 on success; all three or the change is pointless, but none is harmful.
  global _kept
  _kept = all(
    libc.mallopt(param, value) == 1
    for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
  )
  return _kept


def freed_memory_kept() -> bool:
  """Whether `keep_freed_host_memory` has changed this process's malloc settings."""
  return _kept
