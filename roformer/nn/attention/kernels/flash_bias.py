"""`flash_bias` (TPU): Pallas flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`),
which adds a dense bias `ab` [B, H, L, S] to the logits and returns its gradient: the relative
biases (T5, ALiBi, KERPLE, FIRE, Sandwich) and FoX's forget gate; every mask is folded into that
bias. No sinks, no GQA of its own (keys and values are repeated over each group's query heads;
their gradients sum back through the repeat).

Off a TPU it runs in interpret mode (slow, exact) when asked for by name; `auto` never picks it
there. Sequences are padded to a multiple of the TPU lanes, head dims the kernel does not take
(above 128 and not a multiple of it) to one on a TPU (zeros add nothing to q.k and give zero
output columns, which are cut; logged), and values narrower than the queries (PoPE) to their
width; queries are scaled by 1 / sqrt(K) before the kernel.

Dimension legend as call.py; P the padded sequence length, W the padded head width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import base, padding, sharding
from roformer.nn.attention.kernels.base import Kernel, needs_logits, refuse, register_kernel
from roformer.nn.attention.primitives import NEG, add_key_bias, attention_mask, check_ranks

# `auto` leaves a call to the XLA kernels when a [B, H, L, S] float32 bias would take more than
# this per device; the chunked kernel computes it block by block.
AUTO_BIAS_BYTES = 1 << 30


def misfit(f: Features) -> str | None:
  """The fused kernels' common refusals, sinks, and cross-attention."""
  if reason := needs_logits(f):
    return reason
  if f.sinks:
    return "it has no sink logit (model.attention_sinks); use splash"
  if f.key_length and f.key_length != f.length:
    return f"it runs self-attention; got L={f.length}, S={f.key_length}"
  return None


def auto_misfit(f: Features) -> str | None:
  """What `auto` adds: no windows (the banded XLA kernel visits only the window's key blocks),
  and no dense bias over AUTO_BIAS_BYTES per device."""
  if f.window:
    return "windows go to the banded XLA kernel"
  bias_bytes = f.batch * f.heads * padding.round_up(f.length, padding.LANES) ** 2 * 4 // f.devices
  if bias_bytes > AUTO_BIAS_BYTES:
    return f"its [B, H, L, S] bias would take {bias_bytes / (1 << 30):.1f} GiB per device"
  return None


def flash_bias_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
  """Self-attention through the Pallas flash attention with a dense logit bias; args and returns
  as `dense_attention`. The bias is the encoding's, plus FoX's -c_j, plus NEG where the mask
  (causal, windows, global tokens, all on positions) forbids a pair; with no bias and no window
  there is none, and the kernel's causal flag (on indices, as splash's masks) and segment ids
  mask alone."""
  check_ranks(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS)
  bias_BHLS = None if call.bias_fn is None else call.bias_fn(qpos_BL, kpos_BS)
  refuse("flash_bias", misfit(base.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)))
  from jax.experimental.pallas.ops.tpu import flash_attention as flash

  B, L, H, K = q_BLHK.shape
  S, G, V = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGV.shape[3]
  on = base.target_platform()
  width = max(K, V)
  lanes = on == "tpu" and width > padding.LANES
  P, W = padding.round_up(L, padding.LANES), padding.head_width(q_BLHK, v_BSGV, lanes=lanes)
  causal, window = call.causal, call.window
  ab_BHLS = add_key_bias(bias_BHLS, call.key_bias_BSH, L)
  ab_BHPP = None  # no bias and no window: the kernel's causal flag and segment ids suffice
  if ab_BHLS is not None or window > 0:
    allowed_BLS = attention_mask(
      qpos_BL, kpos_BS, causal=causal, window=window, window_kind=call.window_kind,
      global_tokens=call.global_tokens,
    )  # fmt: skip
    ab_BHLS = jnp.zeros((B, H, L, S), jnp.float32) if ab_BHLS is None else ab_BHLS
    ab_BHLS = jnp.broadcast_to(ab_BHLS.astype(jnp.float32), (B, H, L, S))
    ab_BHLS = jnp.where(allowed_BLS[:, None], ab_BHLS, NEG)
    ab_BHPP = padding.pad_axis(padding.pad_axis(ab_BHLS, 2, P), 3, P)
  R = H // G
  pad = padding.pad_axis
  q = pad(pad(q_BLHK * (1.0 / math.sqrt(K)), 3, W), 1, P)
  # The kernel wants as many key/value heads as query heads: head h = g * R + r reads group g.
  k, v = (jnp.repeat(pad(pad(x, 3, W), 1, P), R, axis=2) for x in (k_BSGK, v_BSGV))
  qseg, kseg = padding.padded_segments(call.qseg_BL, call.kseg_BS, B, L, S, P)
  block = padding.lane_block(P, call.block)
  sizes = flash.BlockSizes(
    block_q=block, block_k_major=block, block_k=block, block_b=1, block_q_major_dkv=block,
    block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block, block_k_major_dq=block,
    block_k_dq=block, block_q_dq=block,
  )  # fmt: skip

  def run(q_BPHW, k_BPHW, v_BPHW, ab_BHPP, qseg_BP, kseg_BP):
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    segments = None if qseg_BP is None else flash.SegmentIds(q=qseg_BP, kv=kseg_BP)
    o_BHPW = flash.flash_attention(
      *map(heads_first, (q_BPHW, k_BPHW, v_BPHW)), ab_BHPP, segments, causal=causal,
      sm_scale=1.0, block_sizes=sizes,
    )  # fmt: skip
    return o_BHPW.transpose(0, 2, 1, 3)

  if on != "tpu":  # explicitly asked for off a TPU: Pallas's TPU interpreter
    run = _interpreted(run)
  o_BPHW = sharding.shard(
    run, sharding.mesh_specs(B, H),
    ((q, ("B", None, "H", None)), (k, ("B", None, "H", None)), (v, ("B", None, "H", None)),
     (ab_BHPP, ("B", "H", None, None)), (qseg, ("B", None)), (kseg, ("B", None))),
  )  # fmt: skip
  return o_BPHW[:, :L, :, :V].astype(q_BLHK.dtype)


def _interpreted(fn):
  """`fn` with the Pallas TPU kernels it traces, forward and backward, in interpret mode. The
  flash kernel has no `interpret` argument and its backward pass is traced after the forward
  one, outside any context manager around the call: this VJP re-enters it for both.

  The mode is `True`, Pallas's HLO interpreter (what splash's `interpret=True` selects), not an
  `InterpretParams`, whose TPU simulator (threads standing in for cores and DMAs) stalls in
  some runs on a CPU."""
  import jax.experimental.pallas.tpu as pltpu

  @jax.custom_vjp
  def call(*args):
    with pltpu.force_tpu_interpret_mode(True):
      return fn(*args)

  def call_fwd(*args):
    with pltpu.force_tpu_interpret_mode(True):
      return jax.vjp(fn, *args)

  def call_bwd(vjp_fn, g):
    with pltpu.force_tpu_interpret_mode(True):
      return vjp_fn(g)

  call.defvjp(call_fwd, call_bwd)
  return call


KERNEL = register_kernel(
  Kernel(
    "flash_bias", "tpu", misfit, flash_bias_attention, auto_misfit, emulated=flash_bias_attention
  )
)
