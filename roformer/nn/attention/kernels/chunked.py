"""`chunked`: the blockwise online-softmax kernel, memory O(L * block) at any length; windowed
self-attention runs banded (`roformer.nn.attention.banded`).

Dimension legend as call.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from roformer.nn.attention import banded, sinks
from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels.base import Kernel, features, refuse, register_kernel
from roformer.nn.attention.piecewise import pieces_cover, piecewise_scores
from roformer.nn.attention.primitives import (
  add_key_bias,
  attention_mask,
  check_ranks,
  for_each_query_block,
  online_softmax_init,
  online_softmax_output,
  online_softmax_step,
  online_softmax_update,
  split_blocks,
  split_heads,
)


def chunked_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
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

  Args and returns: as `dense_attention`; `call.block` is the query and key block size. A
  content bias is refused (`misfit`): its cumulative sums run across key blocks. The bias comes
  from `call.bias_fn`, block by block.
  """
  v_BSGK = v_BSGV
  check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  refuse("chunked", misfit(features(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, call)))
  qseg_BL, kseg_BS, causal, window = call.qseg_BL, call.kseg_BS, call.causal, call.window
  window_kind, global_tokens, block = call.window_kind, call.global_tokens, call.block
  bias_fn, pieces_fn, rotate_fn = call.bias_fn, call.pieces_fn, call.rotate_fn
  dropout_rate, dropout_key = call.dropout_rate, call.dropout_key
  sink_H, key_bias_BSH = call.sink_H, call.key_bias_BSH
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


def misfit(features: Features) -> str | None:
  if features.content_bias:
    return (
      "the chunked attention kernel cannot add a content-dependent positional bias (posenc.kind="
      "'cope'), whose cumulative sums run across key blocks; set model.attention_impl to 'dense' "
      "or 'auto'"
    )
  return None


KERNEL = register_kernel(Kernel("chunked", None, misfit, chunked_attention))
