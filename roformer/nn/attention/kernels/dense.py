"""`dense`: the reference kernel, which materialises the [L, S] scores (fp32 softmax) and runs
every call; causal self-attention in query blocks over the keys up to each block's end.

Dimension legend as call.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from roformer.nn.attention import sinks
from roformer.nn.attention.block_pairs import attend_pairs, pairs
from roformer.nn.attention.blocks import attend_spans, logits, rows_einsum
from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels.base import Kernel, register_kernel
from roformer.nn.attention.piecewise import piecewise_scores
from roformer.nn.attention.primitives import (
  NEG,
  add_key_bias,
  attention_mask,
  check_ranks,
  dropout,
  row_max,
)


def dense_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
  """Reference kernel: materialises the [L, S] scores, fp32 softmax.

  Causal self-attention (S = L, no content bias, no attention dropout) runs in query blocks
  (`causal_query_blocks`), each over the keys up to its last query: the keys after it are masked
  for every query of the block, so their scores are not computed (5/8 of the [L, S] work at
  L = 512). The result equals the unsplit kernel's to float32 rounding. With no other mask
  (segments, window, global tokens, piecewise positions) and equal blocks, the blocks run as
  pairs of query and key blocks (`block_pairs.attend_pairs`), so no block's keys are copied.

  Args:
    q_BLHK: queries (already rotated unless `call.pieces_fn`), any float dtype.
    k_BSGK, v_BSGV: keys (likewise) and values; H must be a multiple of G.
    qpos_BL, kpos_BS: int positions of queries and keys (for the mask and the bias).
    call: the mask, the logit terms and dropout (`AttentionCall`); every call fits.

  Returns:
    [B, L, H, V] (V the value width) in the dtype of q. A query with no allowed key gets zeros.
  """
  v_BSGK = v_BSGV
  check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  qseg_BL, kseg_BS, causal, window = call.qseg_BL, call.kseg_BS, call.causal, call.window
  bias_fn, content_bias_fn, pieces_fn = call.bias_fn, call.content_bias_fn, call.pieces_fn
  sink_H, key_bias_BSH, global_tokens = call.sink_H, call.key_bias_BSH, call.global_tokens
  dropout_rate, dropout_key = call.dropout_rate, call.dropout_key
  B, L, H, K = q_BLHK.shape
  S, G, V = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGK.shape[3]
  # Bidirectional attention over one segment needs no mask at all.
  masked = qseg_BL is not None or causal or window > 0 or pieces_fn is not None
  sink_GR = sinks.grouped(sink_H, G)
  spans = [(0, L, S)]
  if causal and S == L and content_bias_fn is None and (dropout_key is None or not dropout_rate):
    spans = causal_query_blocks(L)
  # Causal blocks with no other mask: a block's keys before its first query are all allowed
  # (by the assumption `causal_query_blocks` states), so its mask covers only the keys from its
  # first query on, and only those logits are written twice.
  diagonal = len(spans) > 1 and qseg_BL is None and kseg_BS is None and not window
  diagonal = diagonal and not global_tokens and pieces_fn is None
  if diagonal and L % len(spans) == 0:  # equal blocks: pairs of blocks, no key prefix copied
    return _causal_pairs(
      q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, len(spans), bias_fn, key_bias_BSH, sink_GR
    )
  # Heads first: every product is a GEMM batched over (B, G) with one contracting axis, which
  # XLA:CPU runs on the [L, S] operands in place; with the heads after the positions it copies
  # them into a transposed layout, in the forward pass and again in the backward pass.
  q_BGRLK = q_BLHK.reshape(B, L, G, H // G, K).transpose(0, 2, 3, 1, 4)
  k_BGSK, v_BGSK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  o_blocks, blocks = [], []
  for start, end, keys in spans:
    qpos_BT, kpos_BE = qpos_BL[:, start:end], kpos_BS[:, :keys]
    mask_BTE = None
    if diagonal:
      mask_BTE = attention_mask(qpos_BT, kpos_BS[:, start:keys], causal=True)
    elif masked:
      mask_BTE = attention_mask(
        qpos_BT, kpos_BE, None if qseg_BL is None else qseg_BL[:, start:end],
        None if kseg_BS is None else kseg_BS[:, :keys], causal=causal, window=window,
        window_kind=call.window_kind, global_tokens=global_tokens,
      )  # fmt: skip
    bias_BHTE = None if bias_fn is None else bias_fn(qpos_BT, kpos_BE)
    kbias_BEH = None if key_bias_BSH is None else key_bias_BSH[:, :keys]
    bias_BHTE = add_key_bias(bias_BHTE, kbias_BEH, end - start)
    if content_bias_fn is not None:  # one span: the whole [L, S]
      content_BHLS = content_bias_fn(q_BLHK, k_BSGK, mask_BTE)
      bias_BHTE = content_BHLS if bias_BHTE is None else bias_BHTE + content_BHLS
    if pieces_fn is None and (dropout_key is None or not dropout_rate):
      blocks.append((mask_BTE, _grouped_bias(bias_BHTE, B, G)))
      continue
    if pieces_fn is None:  # with attention dropout (one span)
      o_BGRTK = _dropout_attention(
        q_BGRLK, k_BGSK, v_BGSK, mask_BTE, bias_BHTE, sink_GR, dropout_rate, dropout_key
      )
    else:
      s_BGRTE, covered_BTE = piecewise_scores(
        q_BLHK[:, start:end], k_BSGK[:, :keys], qpos_BT, kpos_BE, bias_BHTE,
        pieces_fn=pieces_fn, rotate_fn=call.rotate_fn,
      )  # fmt: skip
      mask_BTE = mask_BTE & covered_BTE
      o_BGRTK = _softmax_values(
        s_BGRTE, v_BGSK[:, :, :keys], mask_BTE, sink_GR, dropout_rate, dropout_key
      )
    o_blocks.append(o_BGRTK)
  if blocks:
    masks, biases = zip(*blocks, strict=True)
    o_BGRLK = attend_spans(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, tuple(spans))
  else:
    o_BGRLK = o_blocks[0] if len(o_blocks) == 1 else jnp.concatenate(o_blocks, axis=3)
  return o_BGRLK.transpose(0, 3, 1, 2, 4).reshape(B, L, H, V).astype(q_BLHK.dtype)


def _causal_pairs(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, n, bias_fn, key_bias_BSH, sink_GR):
  """Causal self-attention in n equal blocks through `block_pairs.attend_pairs`: q, k and v
  laid out [N, B, G, (R,) T, K] in one transpose each (every key written once), a mask on each
  diagonal pair (the keys of earlier blocks are earlier, as `causal_query_blocks` assumes) and
  each pair's bias from the pair's positions."""
  B, L, H, K = q_BLHK.shape
  G, V, T = k_BSGK.shape[2], v_BSGK.shape[3], L // n
  q_NBGRTK = q_BLHK.reshape(B, n, T, G, H // G, K).transpose(1, 0, 3, 4, 2, 5)
  k_NBGTK = k_BSGK.reshape(B, n, T, G, K).transpose(1, 0, 3, 2, 4)
  v_NBGTV = v_BSGK.reshape(B, n, T, G, V).transpose(1, 0, 3, 2, 4)
  qpos_NBT = [qpos_BL[:, i * T : (i + 1) * T] for i in range(n)]
  kpos_NBT = [kpos_BS[:, i * T : (i + 1) * T] for i in range(n)]
  masks = tuple(attention_mask(qpos_NBT[i], kpos_NBT[i], causal=True) for i in range(n))
  biases = []
  for i, j in pairs(n):
    bias_BHTT = None if bias_fn is None else bias_fn(qpos_NBT[i], kpos_NBT[j])
    kbias_BTH = None if key_bias_BSH is None else key_bias_BSH[:, j * T : (j + 1) * T]
    biases.append(_grouped_bias(add_key_bias(bias_BHTT, kbias_BTH, T), B, G))
  o_NBGRTV = attend_pairs(q_NBGRTK, k_NBGTK, v_NBGTV, masks, tuple(biases), sink_GR)
  return o_NBGRTV.transpose(1, 0, 4, 2, 3, 5).reshape(B, L, H, V).astype(q_BLHK.dtype)


# Rows per query block of causal self-attention in the dense kernel: GEMMs of 128 rows still run
# near XLA:CPU's matmul peak, and 4 blocks at L = 512 already do 5/8 of the full [L, S] work.
CAUSAL_QUERY_BLOCK = 128
CAUSAL_MAX_BLOCKS = 8


def causal_query_blocks(length: int) -> list[tuple[int, int, int]]:
  """(start, end, keys) of the query blocks causal self-attention over `length` tokens splits
  into: rows [start, end) attend to keys [0, keys) with keys = end.

  The keys after a block's last query are skipped by index, under the assumption `banded.py`
  states: within a segment positions advance by at least one per token, so a key at a later
  index is at a later position (masked by causality) or in another segment (masked anyway).
  Inside each block `attention_mask` decides exactly, except that with no segment ids, window
  or global tokens `dense_attention` masks only the keys from the block's first query on: by
  the same assumption (queries and keys at the same positions) the keys before it are earlier.
  """
  n = min(CAUSAL_MAX_BLOCKS, -(-length // CAUSAL_QUERY_BLOCK))
  if n < 2:
    return [(0, length, length)]
  size = -(-length // n)
  return [(s, min(s + size, length), min(s + size, length)) for s in range(0, length, size)]


def _dropout_attention(
  q_BGRLK, k_BGSK, v_BGSK, mask_BLS, bias_BHLS, sink_GR, dropout_rate, dropout_key
):
  """softmax(q k / sqrt(K) + bias, masked) v with attention dropout over heads-first operands:
  [B, G, R, L, K] (fp32 scores and softmax), with the sink logits [G, R] (or None) in every
  row's denominator. Without dropout the kernels run `blocks.attend_spans`."""
  B, G = q_BGRLK.shape[:2]
  bias_BGRLS = _grouped_bias(bias_BHLS, B, G)
  s_BGRLS = logits(q_BGRLK, k_BGSK, None, bias_BGRLS)
  return _softmax_values(s_BGRLS, v_BGSK, mask_BLS, sink_GR, dropout_rate, dropout_key)


def _softmax_values(s_BGRLS, v_BGSK, mask_BLS, sink_GR, dropout_rate, dropout_key):
  """softmax(masked logits [B, G, R, L, S], the sink in the denominator) v, heads first:
  [B, G, R, L, K] (fp32 softmax), by autodiff: for attention dropout and for logits merged from
  piecewise positions."""
  if mask_BLS is not None:
    s_BGRLS = jnp.where(mask_BLS[:, None, None], s_BGRLS, NEG)
  p_BGRLS = dropout(_probabilities(s_BGRLS, sink_GR), dropout_rate, dropout_key)
  o_BGRLK = rows_einsum("bgms,bgsk->bgmk", p_BGRLS.astype(v_BGSK.dtype), v_BGSK)
  if mask_BLS is not None:  # a query with no allowed key gets zeros (as `attend_spans` gives)
    o_BGRLK = jnp.where(mask_BLS.any(axis=-1)[:, None, None, :, None], o_BGRLK, 0.0)
  return o_BGRLK


def _probabilities(s_BGRLS, sink_GR):
  """Softmax over the keys, the sink (if any) one more term of the denominator."""
  if sink_GR is None:
    return jax.nn.softmax(s_BGRLS, axis=-1)
  sink_1GR11 = sink_GR[None, :, :, None, None]
  m_BGRL1 = jnp.maximum(row_max(s_BGRLS)[..., None], sink_1GR11)
  e_BGRLS = jnp.exp(s_BGRLS - m_BGRL1)
  return e_BGRLS / (e_BGRLS.sum(axis=-1, keepdims=True) + jnp.exp(sink_1GR11 - m_BGRL1))


def _grouped_bias(bias_BHLS, B, G):
  """A bias [B or 1, H, L, S] as float32 [B, G, R, L, S] (None stays None)."""
  if bias_BHLS is None:
    return None
  _, H, L, S = bias_BHLS.shape
  bias_BGRLS = bias_BHLS.astype(jnp.float32).reshape(-1, G, H // G, L, S)
  return jnp.broadcast_to(bias_BGRLS, (B, G, H // G, L, S))


def misfit(features: Features) -> str | None:
  """Every call fits the dense kernel."""
  del features
  return None


KERNEL = register_kernel(Kernel("dense", None, misfit, dense_attention))
