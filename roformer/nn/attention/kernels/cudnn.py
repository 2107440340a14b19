"""`cudnn` (GPU): `jax.nn.dot_product_attention(implementation="cudnn")`: bias, causal and causal
sliding windows natively, any other mask as a boolean mask, GQA natively. Its emulation runs the
same call through XLA's implementation, which checks this adapter on any machine.

Dimension legend as call.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import base, sharding
from roformer.nn.attention.kernels.base import Kernel, needs_logits, refuse, register_kernel
from roformer.nn.attention.kernels.padding import pad_axis
from roformer.nn.attention.primitives import attention_mask, check_ranks


def misfit(f: Features) -> str | None:
  """The fused kernels' common refusals, sinks, a key bias across lengths and, where known,
  cuDNN's hardware, dtypes, head dims and (on its hardware) even lengths under a bias."""
  if reason := needs_logits(f):
    return reason
  if f.sinks:
    return "cuDNN's kernel has no sink logit (model.attention_sinks)"
  if f.platform not in (None, "gpu"):
    return f"cuDNN runs on a GPU, not on {f.platform}"
  if f.dtype and f.dtype not in ("bfloat16", "float16"):
    return f"cuDNN's flash attention takes bfloat16 or float16, not {f.dtype} (model.dtype)"
  if f.head_dim and (f.head_dim % 8 or f.head_dim > 128):
    return f"cuDNN takes head dims that are multiples of 8 up to 128, not {f.head_dim}"
  if f.platform is not None and f.length % 2 and (f.bias or f.key_bias):
    return f"cuDNN adds a bias only at even lengths, not {f.length}"
  if f.key_bias and f.key_length and f.key_length != f.length:
    return f"a key bias runs in self-attention; got L={f.length}, S={f.key_length}"
  return None


def auto_misfit(f: Features) -> str | None:
  """What `auto` adds: no windows (cuDNN's count token indices, which differ from positions
  under randomized or offset positions; the banded XLA kernel visits only the window's key
  blocks), and self-attention only."""
  if f.window:
    return "windows go to the banded XLA kernel"
  if f.key_length != f.length:
    return "auto runs it on self-attention only"
  return None


def cudnn_attention(
  q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall, *, implementation="cudnn"
):
  """Self-attention through `jax.nn.dot_product_attention`; args and returns as
  `dense_attention`. Causal attention and causal sliding windows go to cuDNN as such, with no
  mask (its causal kernel skips the masked blocks); segments and every other window as a
  boolean mask on positions. Only packed batches carry segment ids, so an unpacked run's calls
  take the unmasked kernels.

  `implementation="xla"` (`emulated`) runs the same call through XLA's implementation, which has
  none of cuDNN's limits (the hardware is not checked)."""
  check_ranks(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS)
  bias_BHLS = None if call.bias_fn is None else call.bias_fn(qpos_BL, kpos_BS)
  features = base.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)
  refuse("cudnn", misfit(features if implementation != "xla" else features.portable()))
  B, L, H, K = q_BLHK.shape
  V = v_BSGV.shape[3]
  causal, window = call.causal, call.window
  window_kind, global_tokens = call.window_kind, call.global_tokens
  native_window = causal and window > 0 and window_kind == "sliding" and not global_tokens
  mask_B1LS = None
  if call.qseg_BL is not None or (window > 0 and not native_window):
    mask_B1LS = attention_mask(
      qpos_BL, kpos_BS, call.qseg_BL, call.kseg_BS, causal=causal, window=window,
      window_kind=window_kind, global_tokens=global_tokens,
    )[:, None]  # fmt: skip
  bias = bias_BHLS
  if (kb_BSH := call.key_bias_BSH) is not None:
    # FoX's -c_j grows with the position; each row's own -c_i, which the softmax ignores, is
    # taken off first (self-attention: key i is query i), so the bias cast to the compute
    # dtype below holds c_i - c_j, small near the diagonal, not the large absolute -c_j.
    kb_BHS = kb_BSH.astype(jnp.float32).transpose(0, 2, 1)
    rel_BHLS = kb_BHS[:, :, None, :] - kb_BHS[:, :, :, None]
    bias = rel_BHLS if bias is None else bias.astype(jnp.float32) + rel_BHLS
  bias = None if bias is None else bias.astype(q_BLHK.dtype)

  def run(q_BLHK, k_BSGK, v_BSGW, bias, mask_B1LS):
    return jax.nn.dot_product_attention(
      q_BLHK, k_BSGK, v_BSGW, bias=bias, mask=mask_B1LS, scale=1.0 / math.sqrt(K),
      is_causal=causal, local_window_size=(window - 1, 0) if native_window else None,
      implementation=implementation,
    )  # fmt: skip

  # Split over the mesh like the other opaque kernels (batch over data and fsdp, heads over
  # tensor), not by the call's own partitioning rule: that rule wants q, k and v sharded alike,
  # which XLA's sharding propagation does not promise (a data x fsdp mesh gave them different
  # ones).
  def split(x_B_LS, heads):  # logical dims of a bias or mask, [B or 1, H or 1, L, S]
    if x_B_LS is None:
      return (None,) * 4
    return ("B" if x_B_LS.shape[0] == B else None, "H" if x_B_LS.shape[1] == heads else None,
            None, None)  # fmt: skip

  W = max(K, V)  # values as wide as PoPE's keys
  o_BLHW = sharding.shard(
    run, sharding.mesh_specs(B, k_BSGK.shape[2]),
    ((q_BLHK, ("B", None, "H", None)), (k_BSGK, ("B", None, "H", None)),
     (pad_axis(v_BSGV, 3, W), ("B", None, "H", None)), (bias, split(bias, H)),
     (mask_B1LS, split(mask_B1LS, H))),
  )  # fmt: skip
  return o_BLHW[..., :V]


emulated = functools.partial(cudnn_attention, implementation="xla")

KERNEL = register_kernel(
  Kernel("cudnn", "gpu", misfit, cudnn_attention, auto_misfit, emulated=emulated)
)
