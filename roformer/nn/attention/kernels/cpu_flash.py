"""`cpu_flash`: causal self-attention on the CPU through a fused C++ kernel (cpu_flash.cc), the
kernel `auto` picks on a CPU when a call fits it.

XLA:CPU runs attention as separate batched products of small blocks, each near one core's
speed, with the softmax's passes between them; the kernel keeps each query block's scores in a
per-thread buffer, fuses the softmax into the products and spreads the blocks over XLA's
intra-op threads (the file's header has the algorithm). It is built on first use with the
machine's C++ compiler (`$CXX`, else `c++`) for the machine's own CPU (`-march=native`), against
the XLA FFI headers jaxlib ships, and cached in `$ROFORMER_CACHE` (default
`~/.cache/roformer-jax`) under a key of the source, the flags, jaxlib's version and the CPU's
feature flags. Without a compiler `auto` keeps the XLA kernels (logged once); asking for
`cpu_flash` by name then fails with the compiler's message.

What it runs: causal self-attention (L = S) in float32, grouped queries, any length (padded
to a multiple of the block with keys after every real query, which no real query sees) and any
head dim (q, k and v padded with zero columns to a multiple of 16, exact). Its mask is the token
index, which equals the position mask when positions increase along the sequence, as the
dense kernel's causal blocks assume. Everything else (biases, segments, windows, sinks,
dropout, piecewise positions, other dtypes) is refused with the reason (`misfit`), and `auto`
then falls back. Under a mesh of several devices it runs per shard (`sharding.shard`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import base, padding, sharding
from roformer.nn.attention.kernels.base import Kernel, needs_logits, refuse, register_kernel
from roformer.nn.attention.primitives import check_ranks

# The source sits beside the attention package's modules (package data, pyproject.toml).
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu_flash.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# Query rows per unit of work: the padding granularity of the sequence (a multiple of 16).
BLOCK = 64
_TARGETS = {"fwd": "roformer_cpu_flash_fwd", "bwd": "roformer_cpu_flash_bwd"}


def _cpu_features() -> str:
  """The CPU's feature flags (Linux), else the processor's name: part of the build's key, since
  the library is compiled for the machine's own instruction set."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return line
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _compiler() -> list[str] | None:
  """The compiler's command: $CXX (which may hold arguments, e.g. "ccache g++"), else c++."""
  if os.environ.get("CXX"):
    return shlex.split(os.environ["CXX"])
  found = shutil.which("c++") or shutil.which("g++")
  return [found] if found else None


@functools.cache
def build() -> str:
  """The path of the compiled library, building it if this machine has none yet; raises
  RuntimeError with the reason when it cannot be built."""
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
  with open(SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(
    b"\0".join([source, " ".join(FLAGS).encode(), jax.lib.__version__.encode(),
                _cpu_features().encode(), " ".join(cxx).encode()])
  ).hexdigest()[:16]  # fmt: skip
  cache = os.environ.get("ROFORMER_CACHE") or os.path.expanduser("~/.cache/roformer-jax")
  path = os.path.join(cache, f"cpu_flash-{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(cache, exist_ok=True)
  logging.info("building the CPU attention kernel (once per machine): %s", path)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)  # renamed into place: no torn file
  os.close(fd)
  cmd = [*cxx, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  except (OSError, subprocess.TimeoutExpired) as e:
    os.unlink(tmp)
    raise RuntimeError(f"{' '.join(cmd)} failed: {e}") from e
  if done.returncode:
    os.unlink(tmp)
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
  os.replace(tmp, path)
  return path


@functools.cache
def _register(path: str) -> None:
  """Loads the library at `path` and registers its handlers with XLA (once per process: a
  later build of the same source under another key is not registered again)."""
  lib = ctypes.CDLL(path)
  for target, symbol in (("fwd", "RoformerCpuFlashFwd"), ("bwd", "RoformerCpuFlashBwd")):
    if _TARGETS[target] not in _REGISTERED:
      capsule = jax.ffi.pycapsule(getattr(lib, symbol))
      jax.ffi.register_ffi_target(_TARGETS[target], capsule, platform="cpu")
      _REGISTERED.add(_TARGETS[target])


_REGISTERED: set[str] = set()


@functools.cache
def unavailable() -> str | None:
  """Why the kernel cannot run on this machine (it failed to build or load), or None. Cached:
  a failed build is not retried for every attention call of every trace."""
  try:
    _register(build())
  except (RuntimeError, OSError) as e:
    return f"the CPU kernel did not build: {e}"
  return None


def misfit(f: Features) -> str | None:
  """Why a call does not fit `cpu_flash`, or None when it does (the build aside; the platform,
  the lengths and the dtype where known)."""
  if f.platform not in (None, "cpu"):
    return f"it runs on a CPU, not on {f.platform}"
  if not f.causal:
    return "it runs causal attention only"
  if f.key_length and f.key_length != f.length:
    return f"it runs self-attention; got L={f.length}, S={f.key_length}"
  if f.dtype and f.dtype != "float32":
    return f"it runs float32, not {f.dtype} (model.dtype)"
  if reason := needs_logits(f):
    return reason
  if f.bias:
    return "it adds no logit bias"
  others = [name for name in ("sinks", "key_bias", "segments", "window", "global_tokens")
            if getattr(f, name)]  # fmt: skip
  if others:
    return f"it has no {', '.join(others)}"
  return None


def _ffi(target: str, outputs, *args, scale: float):
  _register(build())
  call = jax.ffi.ffi_call(_TARGETS[target], outputs, vmap_method="sequential")
  return call(*args, scale=np.float32(scale), block=np.int64(BLOCK))


def _forward(q_BPHW, k_BPGW, v_BPGW, scale):
  B, P, H, _ = q_BPHW.shape
  out = (
    jax.ShapeDtypeStruct(q_BPHW.shape, jnp.float32),
    jax.ShapeDtypeStruct((B, H, P), jnp.float32),
  )
  return _ffi("fwd", out, q_BPHW, k_BPGW, v_BPGW, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attend(q_BPHW, k_BPGW, v_BPGW, scale):
  return _forward(q_BPHW, k_BPGW, v_BPGW, scale)[0]


def _attend_fwd(q_BPHW, k_BPGW, v_BPGW, scale):
  o_BPHW, lse_BHP = _forward(q_BPHW, k_BPGW, v_BPGW, scale)
  return o_BPHW, (q_BPHW, k_BPGW, v_BPGW, o_BPHW, lse_BHP)


def _attend_bwd(scale, residuals, do_BPHW):
  q, k, v = residuals[:3]
  out = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
  return tuple(_ffi("bwd", out, *residuals, do_BPHW, scale=scale))


_attend.defvjp(_attend_fwd, _attend_bwd)


def cpu_flash_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
  """Causal self-attention through the fused CPU kernel; args and returns as
  `dense_attention` (`call.block` is the XLA kernels' and is ignored). Raises ValueError when
  the call does not fit the kernel (`misfit`) and RuntimeError when it cannot be built."""
  check_ranks(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS)
  refuse("cpu_flash", misfit(base.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)))
  if (reason := unavailable()) is not None:
    raise RuntimeError(f"model.attention_impl='cpu_flash' cannot run: {reason}")
  return attend(q_BLHK, k_BSGK, v_BSGV)


def attend(q_BLHK, k_BSGK, v_BSGV):
  """The kernel on a call already found to fit it (`misfit` None, the library built): what
  `auto` runs after its own checks."""
  B, L, H, K = q_BLHK.shape
  G, V = k_BSGK.shape[2], v_BSGV.shape[3]
  P, W = padding.round_up(L, BLOCK), padding.round_up(max(K, V), 16)
  # Zero columns add nothing to q.k and give zero output columns; keys after the last query are
  # never attended to by a real query, and padded queries' rows are cut (zero gradient).
  pad = padding.pad_axis
  q, k, v = (pad(pad(x, 3, W), 1, P) for x in (q_BLHK, k_BSGK, v_BSGV))
  scale = 1.0 / math.sqrt(K)
  o_BPHW = sharding.shard(
    lambda q, k, v: _attend(q, k, v, scale),
    sharding.mesh_specs(B, G),
    ((q, ("B", None, "H", None)), (k, ("B", None, "H", None)), (v, ("B", None, "H", None))),
  )
  return o_BPHW[:, :L, :, :V]


KERNEL = register_kernel(
  Kernel("cpu_flash", "cpu", misfit, cpu_flash_attention, unavailable=lambda: unavailable())
)
