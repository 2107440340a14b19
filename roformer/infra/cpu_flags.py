"""XLA:CPU flags for training and evaluation, set before JAX starts (this module imports no JAX)."""

import importlib.util
import os

# XLA:CPU's experimental YNNPACK fusions slow this project's train step down (about 13% on a
# 4-layer, 256-wide encoder); an empty fusion-type list turns them off.
CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type="
# Installed plugins that give JAX a non-CPU default backend.
_ACCELERATOR_MODULES = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def runs_on_cpu_only() -> bool:
  """True when JAX will use only the CPU: JAX_PLATFORMS=cpu, or unset with no accelerator plugin."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.strip().lower() == "cpu"
  return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_MODULES)


def set_default_cpu_flags() -> bool:
  """Sets XLA_FLAGS to CPU_XLA_FLAGS if the user set none and JAX runs on CPU only.

  Must run before JAX initialises its backends. Returns True when it set them.
  """
  if "XLA_FLAGS" in os.environ or not runs_on_cpu_only():
    return False
  os.environ["XLA_FLAGS"] = CPU_XLA_FLAGS
  return True
