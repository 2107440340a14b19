"""The interchangeable attention kernels: dense, chunked (online softmax over key blocks), auto,
JAX's fused kernels (fused.py: splash, flash_bias, cudnn) and the fused CPU kernel
(cpu_flash.py).

Dimension legend: B batch, L query length, S key length, H query heads, G key/value heads,
R = H // G query heads per key/value head, K head dim, D model dim. Queries and keys may be wider
than the values (PoPE's are 2K wide): the scores are scaled by 1 / sqrt(the query/key width) and
every output is as wide as the values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from roformer.nn.attention import banded, cpu_flash, fused, sinks
from roformer.nn.attention.block_pairs import attend_pairs, pairs
from roformer.nn.attention.blocks import attend_spans, logits, rows_einsum
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
  L = 512). The result equals the unsplit kernel's to float32 rounding. With no other mask
  (segments, window, global tokens, piecewise positions) and equal blocks, the blocks run as
  pairs of query and key blocks (`block_pairs.attend_pairs`), so no block's keys are copied.

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
  flash_bias on a TPU; cudnn on a GPU), for self-attention; on a CPU `cpu_flash` when the call
  fits it and the kernel built. Otherwise `dense` when L * S <= block**2 (small enough to
  materialise) or with a content bias (which only `dense` computes), else `chunked`."""
  L, S = q_BLHK.shape[1], k_BSGK.shape[1]
  platform = fused.target_platform()
  if platform == "cpu":
    reason = (
      cpu_flash.misfit(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, kwargs, platform)
      or cpu_flash.unavailable()
    )
    fused.log_once(
      f"attention_impl=auto, q {tuple(q_BLHK.shape)}: "
      + ("cpu_flash" if reason is None else f"not cpu_flash, {reason}")
    )
    if reason is None:
      return cpu_flash.attend(q_BLHK, k_BSGK, v_BSGK)
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
  "cpu_flash": cpu_flash.cpu_flash_attention,
}
