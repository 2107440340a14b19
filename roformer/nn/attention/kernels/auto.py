"""`auto`: the fastest kernel a call fits on the platform it is for, in `AUTO_ORDER`'s order
(on a TPU splash, then flash_bias; on a GPU cudnn; on a CPU cpu_flash when it built), each
asked its `misfit` and `auto_misfit`; otherwise the XLA kernels: `dense` when L * S <= block**2
(small enough to materialise) or with a content bias (which only `dense` computes), else
`chunked`.

Dimension legend as call.py.
"""

from __future__ import annotations

from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import base
from roformer.nn.attention.kernels.base import Kernel, register_kernel
from roformer.nn.attention.kernels.chunked import chunked_attention
from roformer.nn.attention.kernels.dense import dense_attention

# The kernels `auto` tries on each platform, fastest first, before the XLA kernels.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu_flash",),
  "gpu": ("cudnn",),
  "tpu": ("splash", "flash_bias"),
}


def pick(features: Features, shape: tuple) -> Kernel | None:
  """The first kernel of AUTO_ORDER[features.platform] that fits these features and can run
  here, or None (the XLA kernels); each choice and refusal logged once (`shape`: q's)."""
  for name in AUTO_ORDER.get(features.platform, ()):
    kernel = base.KERNELS[name]
    reason = kernel.misfit(features) or kernel.auto_misfit(features) or kernel.unavailable()
    base.log_once(
      f"attention_impl=auto, q {shape}: " + (name if reason is None else f"not {name}, {reason}")
    )
    if reason is None:
      return kernel
  return None


def auto_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
  """The kernel `auto` picks for this call, run on it; args and returns as `dense_attention`."""
  features = base.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)
  if (kernel := pick(features, tuple(q_BLHK.shape))) is not None:
    return kernel.call(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)
  L, S = q_BLHK.shape[1], k_BSGK.shape[1]
  if L * S <= call.block * call.block or call.content_bias_fn is not None:
    return dense_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)
  return chunked_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)


def misfit(features: Features) -> str | None:
  """Every call fits `auto`: the dense kernel runs what no faster one does."""
  del features
  return None


KERNEL = register_kernel(Kernel("auto", None, misfit, auto_attention))
