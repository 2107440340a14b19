"""The kernel contract: a `Kernel` is a name, a platform, one `misfit(features)` asked both when
a config is checked and when a call runs, and a call `(q, k, v, qpos, kpos, call) -> out`;
`KERNELS` is the registry `model.attention_impl` names.

Dimension legend as call.py.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
from absl import logging

from roformer.nn.attention.call import AttentionCall, Features

# (q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call) -> [B, L, H, V] in the dtype of q.
Array = jax.Array
KernelFn = Callable[[Array, Array, Array, Array, Array, AttentionCall], Array]


def _fits(features: Features) -> str | None:
  del features
  return None


def _built() -> str | None:
  return None


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One attention kernel.

  Attributes:
    name: its `model.attention_impl` value.
    platform: the hardware it compiles for ("cpu", "gpu", "tpu"), or None: any (XLA's own ops).
    misfit: why a call with these features does not fit it, in one line, or None when it does;
      asked when a config is checked (`Features.from_config`) and by the call itself.
    call: the kernel; raises ValueError with `misfit`'s reason on a call that does not fit.
    auto_misfit: what `auto` adds to `misfit` before picking it (a slower or less exact fit).
    unavailable: why it cannot run on this machine (e.g. it did not build), or None.
    emulated: the same adapter run on any machine (Pallas's interpret mode, XLA's implementation
      of the call), which the tests check off the kernel's hardware; None: none.
  """

  name: str
  platform: str | None
  misfit: Callable[[Features], str | None]
  call: KernelFn
  auto_misfit: Callable[[Features], str | None] = _fits
  unavailable: Callable[[], str | None] = _built
  emulated: KernelFn | None = None

  def __call__(self, q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
    o_BLHV = self.call(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)
    expected = (*q_BLHK.shape[:3], v_BSGV.shape[3])
    if getattr(o_BLHV, "shape", None) != expected:  # at trace time: names the kernel at fault
      raise ValueError(
        f"attention kernel {self.name!r} returned {getattr(o_BLHV, 'shape', type(o_BLHV))}, "
        f"not [B, L, H, V] = {expected} (the contract: roformer/nn/attention/kernels/base.py)"
      )
    return o_BLHV


# model.attention_impl -> Kernel, in the order registered.
KERNELS: dict[str, Kernel] = {}


# model.attention_impl -> the module that registered it (which may reuse another's function).
_REGISTERED_BY: dict[str, str] = {}


def plugin_modules() -> dict[str, list[str]]:
  """module -> "model.attention_impl 'NAME'" of each kernel registered outside roformer: what a
  workdir records so that eval.py and generate.py import them again."""
  found: dict[str, list[str]] = {}
  for name in KERNELS:
    module = _REGISTERED_BY.get(name, "roformer.")
    if not module.startswith("roformer."):
      found.setdefault(module, []).append(f"model.attention_impl {name!r}")
  return found


def register_kernel(kernel: Kernel) -> Kernel:
  """Adds `kernel` to KERNELS under its name (a name taken is an error) and returns it."""
  if kernel.name in KERNELS:
    raise ValueError(f"an attention kernel named {kernel.name!r} is registered already")
  KERNELS[kernel.name] = kernel
  # The caller's module: the one a later process must import to have this kernel again.
  _REGISTERED_BY[kernel.name] = sys._getframe(1).f_globals.get("__name__", "__main__")
  return kernel


def refuse(name: str, reason: str | None) -> None:
  """Raises `misfit`'s reason as the one-line error of `model.attention_impl=name`."""
  if reason is not None:
    raise ValueError(f"model.attention_impl={name!r} cannot run this attention: {reason}")


def needs_logits(features: Features) -> str | None:
  """The terms no fused kernel computes (they need the logits or act inside the kernel)."""
  if features.content_bias:
    return "CoPE's content-dependent bias needs the logits, which only the dense kernel has"
  if features.pieces:
    return "piecewise positions (posenc.extension) rotate q and k per piece inside the kernel"
  if features.dropout:
    return "it has no attention dropout (set model.attention_dropout_rate=0, or dense/chunked)"
  return None


def target_platform() -> str:
  """The platform the traced program is for: the devices of the current mesh (a TPU slice's when
  compiling ahead of time on another machine), else JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall) -> Features:
  """The call's features on the platform the program is for."""
  return call.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, platform=target_platform())


@functools.cache
def log_once(message: str) -> None:
  # Tracing runs once per compile, and each message is logged once per process.
  logging.info(message)
