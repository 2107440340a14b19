"""The interchangeable attention kernels: dense, chunked (online softmax over key blocks), auto,
and JAX's fused kernels (fused.py: splash, flash_bias, cudnn).

Dimension legend: B batch, L query length, S key length, H query heads, G key/value heads,
R = H // G query heads per key/value head, K head dim, D model dim. Queries and keys may be wider
than the values (PoPE's are 2K wide): the scores are scaled by 1 / sqrt(the query/key width) and
every output is as wide as the values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from roformer.nn.attention import banded, fused, sinks
from roformer.nn.attention.piecewise import pieces_cover, piecewise_scores
from roformer.nn.attention.primitives import (
  NEG,
  BiasFactorsFn,
  BiasFn,
  ContentBiasFn,
  PiecesFn,
  RotateFn,
  add_key_bias,
  attention_mask,
  check_ranks,
  dropout,
  for_each_query_block,
  online_softmax_init,
  online_softmax_output,
  online_softmax_step,
  online_softmax_update,
  split_blocks,
  split_heads,
)


def dense_attention(
  q_BLHK,
  k_BSGK,
  v_BSGK,
  qpos_BL,
  kpos_BS,
  *,
  qseg_BL=None,
  kseg_BS=None,
  causal: bool = False,
  window: int = 0,
  window_kind: str = "sliding",
  bias_fn: BiasFn | None = None,
  bias_factors_fn: BiasFactorsFn | None = None,
  content_bias_fn: ContentBiasFn | None = None,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
  block: int = 512,
  global_tokens: int = 0,
  pieces_fn: PiecesFn | None = None,
  rotate_fn: RotateFn | None = None,
  sink_H: jax.Array | None = None,
  key_bias_BSH: jax.Array | None = None,
):
  """Reference kernel: materialises the [L, S] scores, fp32 softmax.

  Causal self-attention (S = L, no content bias, no attention dropout) runs in query blocks
  (`causal_query_blocks`), each over the keys up to its last query: the keys after it are masked
  for every query of the block, so their scores are not computed (5/8 of the [L, S] work at
  L = 512). The result equals the unsplit kernel's to float32 rounding.

  Args:
    q_BLHK: queries (already rotated), any float dtype.
    k_BSGK, v_BSGK: keys (already rotated) and values; H must be a multiple of G.
    qpos_BL, kpos_BS: int positions of queries and keys (for masks and `bias_fn`).
    qseg_BL, kseg_BS: int segment ids, or None for a single segment.
    causal, window, window_kind: see `attention_mask`.
    bias_fn: positional bias of a block of positions, e.g. `posenc.bias`.
    bias_factors_fn: the same bias as query and key factors (`posenc.bias_factors`), which
      kernels that add no bias (splash) fold into q and k; the XLA kernels add `bias_fn`'s.
    content_bias_fn: bias from queries, keys and the mask, e.g. `posenc.content_bias` (CoPE).
    dropout_rate, dropout_key: attention-probability dropout (no dropout when the key is None).
    block: unused (kept so every kernel has the same signature).
    global_tokens: see `attention_mask`.
    pieces_fn, rotate_fn: piecewise positions (`roformer.nn.attention.piecewise`): q and k come
      unrotated, each pair's logit is that of the piece covering it under `rotate_fn`, and
      pairs no piece covers are masked. None: q and k come rotated.
    sink_H: per query head sink logits [H] (`sinks.py`), or None for none.
    key_bias_BSH: a bias per key and query head [B, S, H] added to the logits (the forget gate's
      -c_j, `forget_gate.py`), or None.

  Returns:
    [B, L, H, V] (V the value width) in the dtype of q. A query with no allowed key gets zeros.
  """
  del block, bias_factors_fn
  check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  B, L, H, K = q_BLHK.shape
  S, G, V = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGK.shape[3]
  # Bidirectional attention over one segment needs no mask at all.
  masked = qseg_BL is not None or causal or window > 0 or pieces_fn is not None
  # Heads first: every product is a GEMM batched over (B, G) with one contracting axis, which
  # XLA:CPU runs on the [L, S] operands in place; with the heads after the positions it copies
  # them into a transposed layout, in the forward pass and again in the backward pass.
  q_BGRLK = q_BLHK.reshape(B, L, G, H // G, K).transpose(0, 2, 3, 1, 4)
  k_BGSK, v_BGSK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  sink_GR = sinks.grouped(sink_H, G)
  spans = [(0, L, S)]
  if causal and S == L and content_bias_fn is None and (dropout_key is None or not dropout_rate):
    spans = causal_query_blocks(L)
  # Causal blocks with no other mask: a block's keys before its first query are all allowed
  # (by the assumption `causal_query_blocks` states), so its mask covers only the keys from its
  # first query on, and only those logits are written twice.
  diagonal = len(spans) > 1 and qseg_BL is None and kseg_BS is None and not window
  diagonal = diagonal and not global_tokens and pieces_fn is None
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
        window_kind=window_kind, global_tokens=global_tokens,
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
        pieces_fn=pieces_fn, rotate_fn=rotate_fn,
      )  # fmt: skip
      mask_BTE = mask_BTE & covered_BTE
      o_BGRTK = _softmax_values(
        s_BGRTE, v_BGSK[:, :, :keys], mask_BTE, sink_GR, dropout_rate, dropout_key
      )
    o_blocks.append(o_BGRTK)
  if blocks:
    masks, biases = zip(*blocks, strict=True)
    o_BGRLK = _attend_blocks(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, tuple(spans))
  else:
    o_BGRLK = o_blocks[0] if len(o_blocks) == 1 else jnp.concatenate(o_blocks, axis=3)
  return o_BGRLK.transpose(0, 3, 1, 2, 4).reshape(B, L, H, V).astype(q_BLHK.dtype)


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
  row's denominator. Without dropout the kernels run `_attend_blocks`."""
  B, G = q_BGRLK.shape[:2]
  bias_BGRLS = _grouped_bias(bias_BHLS, B, G)
  s_BGRLS = _logits(q_BGRLK, k_BGSK, None, bias_BGRLS)
  return _softmax_values(s_BGRLS, v_BGSK, mask_BLS, sink_GR, dropout_rate, dropout_key)


def _softmax_values(s_BGRLS, v_BGSK, mask_BLS, sink_GR, dropout_rate, dropout_key):
  """softmax(masked logits [B, G, R, L, S], the sink in the denominator) v, heads first:
  [B, G, R, L, K] (fp32 softmax), by autodiff: for attention dropout and for logits merged from
  piecewise positions."""
  if mask_BLS is not None:
    s_BGRLS = jnp.where(mask_BLS[:, None, None], s_BGRLS, NEG)
  p_BGRLS = dropout(_probabilities(s_BGRLS, sink_GR), dropout_rate, dropout_key)
  o_BGRLK = _rows_einsum("bgms,bgsk->bgmk", p_BGRLS.astype(v_BGSK.dtype), v_BGSK)
  if mask_BLS is not None:  # a query with no allowed key gets zeros (as `_attend_blocks` gives)
    o_BGRLK = jnp.where(mask_BLS.any(axis=-1)[:, None, None, :, None], o_BGRLK, 0.0)
  return o_BGRLK


def _probabilities(s_BGRLS, sink_GR):
  """Softmax over the keys, the sink (if any) one more term of the denominator."""
  if sink_GR is None:
    return jax.nn.softmax(s_BGRLS, axis=-1)
  sink_1GR11 = sink_GR[None, :, :, None, None]
  m_BGRL1 = jnp.maximum(s_BGRLS.max(axis=-1, keepdims=True), sink_1GR11)
  e_BGRLS = jnp.exp(s_BGRLS - m_BGRL1)
  return e_BGRLS / (e_BGRLS.sum(axis=-1, keepdims=True) + jnp.exp(sink_1GR11 - m_BGRL1))


def _grouped_bias(bias_BHLS, B, G):
  """A bias [B or 1, H, L, S] as float32 [B, G, R, L, S] (None stays None)."""
  if bias_BHLS is None:
    return None
  _, H, L, S = bias_BHLS.shape
  bias_BGRLS = bias_BHLS.astype(jnp.float32).reshape(-1, G, H // G, L, S)
  return jnp.broadcast_to(bias_BGRLS, (B, G, H // G, L, S))


def _rows_einsum(spec, x_BGRL_, y):
  """float32 `jnp.einsum(spec, x, y)` with x's (R, L) merged into one axis M (of x and of the
  output): one free axis per operand, so neither the product nor its transposes need a copy."""
  B, G, R, L = x_BGRL_.shape[:4]
  out = jnp.einsum(spec, x_BGRL_.reshape(B, G, R * L, -1), y, preferred_element_type=jnp.float32)
  return out.reshape(B, G, R, L, -1)


def _logits(q_BGRLK, k_BGSK, mask_BLS, bias_BGRLS):
  """q k / sqrt(K) + bias, NEG where masked: [B, G, R, L, S] float32."""
  K = q_BGRLK.shape[-1]
  s_BGRLS = _rows_einsum("bgmk,bgsk->bgms", q_BGRLK, k_BGSK) * (1.0 / math.sqrt(K))
  if bias_BGRLS is not None:
    s_BGRLS = s_BGRLS + bias_BGRLS
  if mask_BLS is not None:
    s_BGRLS = _masked(s_BGRLS, mask_BLS)
  return s_BGRLS


def _masked(s_BGRLS, mask_BLT):
  """NEG where the mask [B, L, T] disallows a key. It covers the last T keys of the logits
  [..., L, S], whose first S - T keys are all allowed; with T < S only those T columns are
  rewritten (in place)."""
  T, S = mask_BLT.shape[-1], s_BGRLS.shape[-1]
  if T == S:
    return jnp.where(mask_BLT[:, None, None], s_BGRLS, NEG)
  tail_BGRLT = jnp.where(mask_BLT[:, None, None], s_BGRLS[..., S - T :], NEG)
  return jax.lax.dynamic_update_slice_in_dim(s_BGRLS, tail_BGRLT, S - T, axis=-1)


def _attend_fwd(q_BGRLK, k_BGSK, v_BGSK, mask_BLS, bias_BGRLS, sink_GR):
  scale = 1.0 / math.sqrt(q_BGRLK.shape[-1])
  if bias_BGRLS is None:
    # The logits unscaled: the scale enters the exponentials' pass, and the row max as a
    # positive factor (rounding is monotonic, so max(s) * scale is max(s * scale) exactly), so
    # no pass writes the scaled [L, S] logits. A masked logit is NEG * scale, still exp -> 0.
    s_BGRLS = _rows_einsum("bgmk,bgsk->bgms", q_BGRLK, k_BGSK)
    if mask_BLS is not None:
      s_BGRLS = _masked(s_BGRLS, mask_BLS)
  else:
    s_BGRLS, scale = _logits(q_BGRLK, k_BGSK, mask_BLS, bias_BGRLS), 1.0
  max_BGRL1 = s_BGRLS.max(axis=-1, keepdims=True)
  m_BGRL1 = max_BGRL1 * scale
  if sink_GR is not None:
    m_BGRL1 = jnp.maximum(m_BGRL1, sink_GR[None, :, :, None, None])
  else:
    # A row whose every key is masked (its max is NEG) subtracts 0 instead: e = exp(NEG) = 0,
    # so it gives zero output and zero gradients (a per-row fix, not a pass over [L, S]).
    m_BGRL1 = jnp.where(max_BGRL1 > NEG, m_BGRL1, 0.0)
  e_BGRLS = jnp.exp(s_BGRLS * scale - m_BGRL1)
  l_BGRL = e_BGRLS.sum(axis=-1)
  if sink_GR is not None:  # with a sink, a row with every key masked has l = e_sink = 1, o = 0
    esink_BGRL = jnp.exp(sink_GR[None, :, :, None] - m_BGRL1[..., 0])
    l_BGRL = l_BGRL + esink_BGRL
  ev_BGRLK = _rows_einsum("bgms,bgsk->bgmk", e_BGRLS.astype(v_BGSK.dtype), v_BGSK)
  l_BGRL = jnp.where(l_BGRL == 0.0, 1.0, l_BGRL)
  o_BGRLK = ev_BGRLK / l_BGRL[..., None]
  has_bias = None if bias_BGRLS is None else ()  # structure only: no array kept
  psink_BGRL = None if sink_GR is None else esink_BGRL / l_BGRL
  return o_BGRLK, (q_BGRLK, k_BGSK, v_BGSK, e_BGRLS, l_BGRL, o_BGRLK, has_bias, psink_BGRL)


def _attend_bwd(residuals, do_BGRLK):
  q_BGRLK, k_BGSK, v_BGSK, e_BGRLS, l_BGRL, o_BGRLK, has_bias, psink_BGRL = residuals
  B, G, R, L, K = q_BGRLK.shape
  scale = 1.0 / math.sqrt(K)
  r_BGRL1 = (1.0 / l_BGRL)[..., None]
  do_BGRLK = do_BGRLK.astype(jnp.float32)
  dp_BGRLS = _rows_einsum("bgmk,bgsk->bgms", do_BGRLK.astype(v_BGSK.dtype), v_BGSK)
  # d logits = p (dp - sum_s p dp), with p = e / l and sum_s p dp = do . o.
  delta_BGRL1 = jnp.sum(do_BGRLK * o_BGRLK, axis=-1, keepdims=True)
  ds_BGRLS = e_BGRLS * (dp_BGRLS - delta_BGRL1) * r_BGRL1
  # The 1 / sqrt(K) of the logits scales the [L, K] and [S, K] products, not the [L, S] one.
  dq_BGRLK = _rows_einsum("bgms,bgsk->bgmk", ds_BGRLS.astype(k_BGSK.dtype), k_BGSK)
  M = R * L
  dk_BGSK = jnp.einsum(
    "bgms,bgmk->bgsk", ds_BGRLS.reshape(B, G, M, -1).astype(q_BGRLK.dtype),
    q_BGRLK.reshape(B, G, M, K), preferred_element_type=jnp.float32,
  )  # fmt: skip
  dv_BGSK = jnp.einsum(
    "bgms,bgmk->bgsk", e_BGRLS.reshape(B, G, M, -1).astype(v_BGSK.dtype),
    (do_BGRLK * r_BGRL1).reshape(B, G, M, -1).astype(v_BGSK.dtype),  # as wide as the values
    preferred_element_type=jnp.float32,
  )  # fmt: skip
  dsink_GR = None
  if psink_BGRL is not None:  # -sum over batch and rows of p_sink (do . o)
    dsink_GR = -jnp.sum(psink_BGRL * delta_BGRL1[..., 0], axis=(0, 3))
  return (
    (dq_BGRLK * scale).astype(q_BGRLK.dtype), (dk_BGSK * scale).astype(k_BGSK.dtype),
    dv_BGSK.astype(v_BGSK.dtype), None, None if has_bias is None else ds_BGRLS, dsink_GR,
  )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attend_blocks(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans):
  """softmax attention without dropout over query blocks, with a hand-written backward pass.

  `spans` are (start, end, keys) in order, the last over every key (`causal_query_blocks`, or
  one span (0, L, S)): the rows [start, end) of q attend to the keys [0, keys) with their mask
  and bias (`_masked`); the outputs are joined along L. One custom_vjp for all blocks, so the
  backward pass adds each block's key and value gradients into their prefix of one [S, K]
  buffer in place, instead of padding every block's to S and summing the padded copies (what
  autodiff of the key slices gives).

  The forward pass normalises after the probability-value product (o = (e v) / l with
  e = exp(logits - max) and l its row sum), so the probabilities are never written; the
  backward pass uses the output (sum_s p dp = do . o) instead of a second reduction over the
  [L, S] scores, and needs no mask (e is exactly 0 where masked). Equal to jax.nn.softmax's
  forward and gradients to float32 rounding, except that a row with every key masked gives
  zeros (as `dense_attention` returns for it) rather than uniform weights.

  With sink logits sink_GR (`sinks.py`), the row max also covers the sink and l gains
  exp(sink - max), a key with no value. Its gradient: o = (e v) / l depends on the sink only
  through l, d l / d sink = exp(sink - max), so d o / d sink = -o p_sink with
  p_sink = exp(sink - max) / l, and d loss / d sink = -sum over batch and rows of
  p_sink (do . o), the same do . o that the logits' gradient uses. The logits' gradient keeps
  its form, p (dp - do . o): the sink adds no term to sum_s p dp, having no value.
  """
  return _attend_blocks_fwd(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans)[0]


def _attend_blocks_fwd(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans):
  outputs, residuals = [], []
  for (start, end, keys), mask_BTE, bias_BGRTE in zip(spans, masks, biases, strict=True):
    o_BGRTK, res = _attend_fwd(
      q_BGRLK[:, :, :, start:end], k_BGSK[:, :, :keys], v_BGSK[:, :, :keys], mask_BTE,
      bias_BGRTE, sink_GR,
    )  # fmt: skip
    outputs.append(o_BGRTK)
    residuals.append(res)
  return jnp.concatenate(outputs, axis=3), residuals


def _attend_blocks_bwd(spans, residuals, do_BGRLK):
  n = len(spans)
  dq_blocks, dbiases, dk_BGSK, dv_BGSK, dsink_GR = [None] * n, [None] * n, None, None, None
  # The last block first: its key and value gradients, over every key, start the [S, K] buffers.
  for i in reversed(range(n)):
    start, end, keys = spans[i]
    dq_blocks[i], dk_BGEK, dv_BGEK, _, dbiases[i], dsink = _attend_bwd(
      residuals[i], do_BGRLK[:, :, :, start:end]
    )
    if dk_BGSK is None:
      dk_BGSK, dv_BGSK = dk_BGEK, dv_BGEK
    else:
      dk_BGSK = dk_BGSK.at[:, :, :keys].add(dk_BGEK)
      dv_BGSK = dv_BGSK.at[:, :, :keys].add(dv_BGEK)
    if dsink is not None:
      dsink_GR = dsink if dsink_GR is None else dsink_GR + dsink
  dq_BGRLK = jnp.concatenate(dq_blocks, axis=3)
  return dq_BGRLK, dk_BGSK, dv_BGSK, (None,) * n, tuple(dbiases), dsink_GR


_attend_blocks.defvjp(_attend_blocks_fwd, _attend_blocks_bwd)


def chunked_attention(
  q_BLHK,
  k_BSGK,
  v_BSGK,
  qpos_BL,
  kpos_BS,
  *,
  qseg_BL=None,
  kseg_BS=None,
  causal: bool = False,
  window: int = 0,
  window_kind: str = "sliding",
  bias_fn: BiasFn | None = None,
  bias_factors_fn: BiasFactorsFn | None = None,
  content_bias_fn: ContentBiasFn | None = None,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
  block: int = 512,
  global_tokens: int = 0,
  pieces_fn: PiecesFn | None = None,
  rotate_fn: RotateFn | None = None,
  sink_H: jax.Array | None = None,
  key_bias_BSH: jax.Array | None = None,
):
  """Blockwise online-softmax kernel: memory O(L * block), any L and S.

  A fori_loop runs over query blocks and a scan over key blocks with a running max, denominator
  and accumulator (fp32). The positional bias and the mask are computed per block from positions,
  so no [L, S] array ever exists; key blocks with no allowed key (e.g. after the query block under
  a causal mask) are skipped. Each query block's output is written over the rotated queries it
  was computed from, which no later block reads, so XLA reuses q's buffer for the output instead
  of stacking the blocks into a new one (when L is not a multiple of the block, the last block is
  shifted back to end at L and keeps the rows already written); values narrower than the queries
  (PoPE) get an output buffer of their own (`for_each_query_block`). Both loop bodies are
  rematerialised, so gradients store only the inputs of each query block rather than every
  block's scores. Attention dropout drops the unnormalised block probabilities with a key folded
  from (query block, key block); the denominator is not dropped, which equals dropping the
  normalised probabilities. Sink logits (`sink_H`) start each query block's running max and sum
  (`online_softmax_init`).

  Windowed self-attention without global tokens visits only the key blocks inside the window
  (`roformer.nn.attention.banded`): O(L * w) time instead of a scan over every key block.

  Piecewise positions (`pieces_fn`) score each key block once per piece; a key block no piece
  covers for any query of the block (attention sinks' middle) is skipped like a masked one.

  Args and returns: as `dense_attention`; `block` is the query and key block size. A
  `content_bias_fn` is refused: its cumulative sums run across key blocks.
  """
  del bias_factors_fn  # the bias comes from bias_fn, block by block
  if content_bias_fn is not None:
    raise ValueError(
      "the chunked attention kernel cannot add a content-dependent positional bias (posenc.kind="
      "'cope'); set model.attention_impl to 'dense' or 'auto'"
    )
  check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  B, L, H, K = q_BLHK.shape
  S, G, V = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGK.shape[3]
  if window > 0 and not global_tokens and S == L and pieces_fn is None:
    if banded.visited_blocks(L, block, window, causal) < -(-L // min(block, L)):
      return banded.banded_attention(
        q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, qseg_BL=qseg_BL, kseg_BS=kseg_BS,
        causal=causal, window=window, window_kind=window_kind, bias_fn=bias_fn,
        dropout_rate=dropout_rate, dropout_key=dropout_key, block=block, sink_H=sink_H,
        key_bias_BSH=key_bias_BSH,
      )  # fmt: skip
  R = H // G
  bq, bk = min(block, L), min(block, S)
  nk = -(-S // bk)
  if qseg_BL is None:
    qseg_BL = jnp.zeros((B, L), jnp.int32)
    kseg_BS = jnp.zeros((B, S), jnp.int32)
  # Padded keys are excluded by `kvalid`.
  kvalid_BS = jnp.ones((B, S), bool)
  kbias = () if key_bias_BSH is None else (key_bias_BSH,)  # scanned only when there is one
  k_xs = (jnp.arange(nk),) + tuple(
    split_blocks(x, bk) for x in (k_BSGK, v_BSGK, kpos_BS, kseg_BS, kvalid_BS, *kbias)
  )

  @jax.checkpoint
  def query_block(qi, start, q_BqHK, qpos_Bq, qseg_Bq):
    q_BqGRK = split_heads(q_BqHK, G)

    def key_block(carry, k_args):
      ki, k_BkGK, v_BkGK, kpos_Bk, kseg_Bk, kvalid_Bk, *kbias_BkH = k_args
      mask_BqBk = attention_mask(
        qpos_Bq, kpos_Bk, qseg_Bq, kseg_Bk, causal=causal, window=window,
        window_kind=window_kind, global_tokens=global_tokens,
      )  # fmt: skip
      mask_BqBk &= kvalid_Bk[:, None, :]
      if pieces_fn is not None:  # pairs no piece covers are masked
        mask_BqBk &= pieces_cover(pieces_fn(qpos_Bq, kpos_Bk))
      mask_B11qk = mask_BqBk[:, None, None]

      def update(carry):
        bias = None if bias_fn is None else bias_fn(qpos_Bq, kpos_Bk)
        bias = add_key_bias(bias, kbias_BkH[0] if kbias_BkH else None, bq)
        key = None
        if dropout_key is not None:
          key = jax.random.fold_in(jax.random.fold_in(dropout_key, qi), ki)
        if pieces_fn is not None:
          s_BGRqk, _ = piecewise_scores(
            q_BqHK, k_BkGK, qpos_Bq, kpos_Bk, bias, pieces_fn=pieces_fn, rotate_fn=rotate_fn
          )
          return online_softmax_step(
            carry, s_BGRqk, v_BkGK, mask_B11qk, dropout_rate=dropout_rate, dropout_key=key
          )
        return online_softmax_update(
          carry, q_BqGRK, k_BkGK, v_BkGK, mask_B11qk, bias, dropout_rate=dropout_rate,
          dropout_key=key,
        )  # fmt: skip

      # A key block no query of this block may see is skipped.
      return jax.lax.cond(mask_B11qk.any(), update, lambda c: c, carry), None

    init = online_softmax_init(B, G, R, bq, V, sinks.grouped(sink_H, G))
    carry, _ = jax.lax.scan(jax.checkpoint(key_block), init, k_xs)
    return online_softmax_output(carry, q_BLHK.dtype)

  return for_each_query_block(query_block, q_BLHK, qpos_BL, qseg_BL, block, value_dim=V)


def auto_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, *, block: int = 512, **kwargs):
  """On a TPU or GPU, the fastest fused kernel the call fits (`fused.pick_fused`: splash, then
  flash_bias on a TPU; cudnn on a GPU), for self-attention. Otherwise, and always on a CPU:
  `dense` when L * S <= block**2 (small enough to materialise) or with a content bias (which only
  `dense` computes), else `chunked`."""
  L, S = q_BLHK.shape[1], k_BSGK.shape[1]
  platform = fused.target_platform()
  if platform in ("tpu", "gpu") and L == S:
    probe, factors = fused.probe_bias(kwargs, qpos_BL, kpos_BS)
    if kernel := fused.pick_fused(q_BLHK, kwargs, probe, platform, factors):
      return fused.FUSED[kernel](q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, block=block, **kwargs)
  small = L * S <= block * block
  if small or kwargs.get("content_bias_fn") is not None:
    return dense_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, block=block, **kwargs)
  return chunked_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, block=block, **kwargs)


KERNELS = {
  "dense": dense_attention,
  "chunked": chunked_attention,
  "auto": auto_attention,
  **fused.FUSED,
}
