"""`splash` (TPU): Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`):
block-sparse masks (causal, full, sliding / chunked / blockwise windows, global tokens), segment
ids for packed documents, GQA and sink logits; no bias input, but a bias with query and key
factors (causal ALiBi, Sandwich) and FoX's key bias go folded into q and k as extra columns
(`bias_factors.py`).

Off a TPU it runs in interpret mode (slow, exact) when asked for by name, which is how the
tests check it on CPU; `auto` never picks it there. Sequences are padded to a multiple of the
TPU lanes (padded keys get a segment id no query of the input has), values narrower than the
queries (PoPE) to their width; queries are scaled by 1 / sqrt(K) before the kernel.

Splash's masks are functions of the token index within the sequence, not of the positions the
model passes: they equal the position masks when positions count up by one within each segment
(train.py, eval.py and generation's prefill). The masks that depend on where a position falls
from the segment start (chunked, blockwise, global tokens) are refused with packed documents,
whose positions restart mid-sequence.

Dimension legend as call.py; P the padded sequence length, W the padded head width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from roformer.nn.attention.bias_factors import fold_bias_factors
from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import base, padding, sharding
from roformer.nn.attention.kernels.base import Kernel, needs_logits, refuse, register_kernel
from roformer.nn.attention.primitives import allowed_pairs, check_ranks

# Windows whose mask depends on a position's offset within its segment, not on index distances.
SEGMENT_ALIGNED = ("chunked", "blockwise")


def misfit(f: Features) -> str | None:
  """Why a call does not fit splash: the fused kernels' common refusals, a bias without query and
  key factors, a folded bias with sinks, index-counted masks under packing, cross-attention."""
  if reason := needs_logits(f):
    return reason
  if f.bias and not f.factored:
    return (
      "it adds no logit bias, and this encoding's has no query-key factors to fold into q "
      "and k; use flash_bias"
    )
  if f.bias and f.sinks:
    return (
      "folding a bias into q and k drops its per-query constant, which a sink logit is "
      "compared with; use dense or chunked"
    )
  if f.segments and f.window and (f.window_kind in SEGMENT_ALIGNED or f.global_tokens):
    form = "global tokens" if f.global_tokens else f"{f.window_kind} windows"
    return f"its {form} count token indices, and packed documents restart positions"
  if f.key_length and f.key_length != f.length:
    return f"it runs self-attention; got L={f.length}, S={f.key_length}"
  return None


def auto_misfit(f: Features) -> str | None:
  """What `auto` adds: no windows (the banded XLA kernel visits only the window's key blocks;
  splash's windows count token indices, which differ from positions under randomized or offset
  positions), and no bias folded into q and k in float32 or wider than the heads.

  In a 16-bit dtype a folded ALiBi or FoX bias is as exact as the dense kernel's (three pieces per
  large key factor, float32 sums), Sandwich's within 1.7x (benchmarks/bias_factor_precision.py).
  In float32 the kernel's sums hold ALiBi's m (j - j0) or FoX's -c_j whole, so a logit is off by
  up to 2^-24 of it (2e-4 in the output at 8k tokens, where the dense kernel is exact);
  flash_bias adds the bias as it is. Sandwich's factors are d' wide (model.emb_dim by default):
  folded, they would multiply the q.k work."""
  if f.window:
    return "windows go to the banded XLA kernel"
  if f.factored or f.key_bias:
    if f.dtype == "float32":
      return "in float32 a bias folded into q and k is less exact than flash_bias's"
    if f.fold_width > f.head_dim:  # the factors' columns, before any splitting into pieces
      wider = f.head_dim + f.fold_width
      return f"folding its bias would widen q and k from {f.head_dim} to {wider}"
  return None


@functools.cache
def index_mask(P: int, causal: bool, window: int, window_kind: str, global_tokens: int):
  """Splash's computable mask of `attention_mask`'s rule on token indices [P, P], evaluated
  lazily per block (no [P, P] array is built)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  def rule(q_ids, k_ids):  # numpy index arrays when planning blocks, traced ones in the kernel
    allowed = allowed_pairs(
      q_ids, k_ids, causal=causal, window=window, window_kind=window_kind,
      global_tokens=global_tokens,
    )  # fmt: skip
    return (q_ids >= 0) & (k_ids >= 0) if allowed is None else allowed

  class RuleMask(masks._ComputableMask):  # one class per rule (cached), so equal iff same type
    def __eq__(self, other):
      return type(other) is type(self)

    def __hash__(self):
      return hash((P, causal, window, window_kind, global_tokens))

  return RuleMask(shape=(P, P), mask_function=rule)


def _splash_kernel(H: int, P: int, block: int, rule: tuple, interpret: bool):
  """Splash's kernel for H heads of one mask rule. Made anew in every trace: the kernel holds its
  masks' block tables as arrays, which are the trace's constants (a kernel kept across traces
  would hand one trace's values to the next). The costly part, evaluating the mask block by
  block, is cached by splash itself per mask (`index_mask` returns the same one)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  mask = masks.MultiHeadMask([index_mask(P, *rule)] * H)
  blocks = splash.BlockSizes(
    block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
    block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
  )  # fmt: skip
  return splash.make_splash_mha(
    mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
  )


def splash_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
  """Self-attention through Pallas splash attention; args and returns as `dense_attention`.
  A positional bias with query and key factors and FoX's key bias go folded into q and k
  (`bias_factors.py`). Splash never needs the bias itself: it is probed on one pair."""
  check_ranks(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS)
  refuse("splash", misfit(base.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)))
  factors = None
  if call.probe_bias(qpos_BL, kpos_BS)[1] is not None:  # the factors of every position
    factors = call.bias_factors_fn(qpos_BL, kpos_BS)
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  B, L, H, K = q_BLHK.shape
  S, V = k_BSGK.shape[1], v_BSGV.shape[3]
  on = base.target_platform()
  P, W = padding.round_up(L, padding.LANES), padding.head_width(q_BLHK, v_BSGV, lanes=False)
  q, k, v = (padding.pad_axis(x, 3, W) for x in (q_BLHK * (1.0 / math.sqrt(K)), k_BSGK, v_BSGV))
  terms = [] if factors is None else [factors]
  if call.key_bias_BSH is not None:
    terms.append((None, call.key_bias_BSH.astype(jnp.float32)[..., None]))
  if terms:
    q, k, v = fold_bias_factors(q, k, v, terms)
  q, k, v = (padding.pad_axis(x, 1, P) for x in (q, k, v))
  G = k.shape[2]
  qseg, kseg = padding.padded_segments(call.qseg_BL, call.kseg_BS, B, L, S, P)
  rule = (call.causal, call.window, call.window_kind, call.global_tokens)
  block, sink_H = padding.lane_block(P, call.block), call.sink_H

  def run(q_BPHW, k_BPGW, v_BPGW, qseg_BP, kseg_BP, sink_H):
    # The heads of this device's shard (all of them without a mesh).
    kernel = _splash_kernel(q_BPHW.shape[2], P, block, rule, on != "tpu")

    def one(q_HPW, k_GPW, v_GPW, qseg_P, kseg_P):
      segments = None if qseg_P is None else splash.SegmentIds(q=qseg_P, kv=kseg_P)
      return kernel(q_HPW, k_GPW, v_GPW, segment_ids=segments, sinks=sink_H)

    heads_first = lambda x: None if x is None else x.transpose(0, 2, 1, 3)  # noqa: E731
    o_BHPW = jax.vmap(one)(*map(heads_first, (q_BPHW, k_BPGW, v_BPGW)), qseg_BP, kseg_BP)
    return o_BHPW.transpose(0, 2, 1, 3)

  o_BPHW = sharding.shard(
    run, sharding.mesh_specs(B, G),
    ((q, ("B", None, "H", None)), (k, ("B", None, "H", None)), (v, ("B", None, "H", None)),
     (qseg, ("B", None)), (kseg, ("B", None)), (sink_H, ("H",))),
  )  # fmt: skip
  return o_BPHW[:, :L, :, :V].astype(q_BLHK.dtype)


KERNEL = register_kernel(
  Kernel("splash", "tpu", misfit, splash_attention, auto_misfit, emulated=splash_attention)
)
