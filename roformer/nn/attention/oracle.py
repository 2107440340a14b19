"""The naive attention every kernel is checked against: the whole [B, H, L, S] logits in float32
by plain einsums, the mask, every logit term of the call, one softmax (sinks in its denominator)
and the values. No blocks, no custom VJP: its gradients are autodiff's.

Dimension legend as call.py.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.primitives import NEG, attention_mask, check_ranks, dropout, row_max


def reference_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
  """softmax(q k^T / sqrt(K) + the call's logit terms, masked) v, materialised in float32.

  Args and returns as the kernels' (`roformer.nn.attention.kernels`): q [B, L, H, K], k [B, S, G,
  K], v [B, S, G, V], int positions [B, L] and [B, S], the call; [B, L, H, V] in the dtype of q,
  zeros for a query with no allowed key. Piecewise positions (`call.pieces_fn`) take each pair's
  logit from the piece that covers it, with q and k rotated by `call.rotate_fn` per piece; pairs
  no piece covers are masked. Attention dropout, with `call.dropout_key`, drops the normalised
  probabilities with one draw over [B, H, L, S] (the kernels draw per block: their dropped
  outputs differ from these, their expectations do not).
  """
  check_ranks(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS)
  H, K, G = q_BLHK.shape[2], q_BLHK.shape[3], k_BSGK.shape[2]
  group_H = jnp.arange(H) // (H // G)  # query head h reads key/value head h // (H // G)
  allowed_BLS = attention_mask(
    qpos_BL, kpos_BS, call.qseg_BL, call.kseg_BS, causal=call.causal, window=call.window,
    window_kind=call.window_kind, global_tokens=call.global_tokens,
  )  # fmt: skip
  q32_BLHK = q_BLHK.astype(jnp.float32)
  k32_BSHK = k_BSGK.astype(jnp.float32)[:, :, group_H]
  if call.pieces_fn is None:
    s_BHLS = jnp.einsum("blhk,bshk->bhls", q32_BLHK, k32_BSHK)
  else:
    s_BHLS, covered_BLS = _piecewise_logits(q_BLHK, k_BSGK, qpos_BL, kpos_BS, call, group_H)
    allowed_BLS &= covered_BLS
  s_BHLS = s_BHLS / math.sqrt(K)
  if call.bias_fn is not None and (bias := call.bias_fn(qpos_BL, kpos_BS)) is not None:
    s_BHLS = s_BHLS + bias.astype(jnp.float32)
  if call.key_bias_BSH is not None:
    s_BHLS = s_BHLS + call.key_bias_BSH.astype(jnp.float32).transpose(0, 2, 1)[:, :, None, :]
  if call.content_bias_fn is not None:
    s_BHLS = s_BHLS + call.content_bias_fn(q_BLHK, k_BSGK, allowed_BLS).astype(jnp.float32)
  s_BHLS = jnp.where(allowed_BLS[:, None], s_BHLS, NEG)
  m_BHL1 = row_max(s_BHLS)[..., None]
  sink_1H11 = None
  if call.sink_H is not None:
    sink_1H11 = call.sink_H.astype(jnp.float32)[None, :, None, None]
    m_BHL1 = jnp.maximum(m_BHL1, sink_1H11)
  e_BHLS = jnp.where(allowed_BLS[:, None], jnp.exp(s_BHLS - m_BHL1), 0.0)
  denominator_BHL1 = e_BHLS.sum(axis=-1, keepdims=True)
  if sink_1H11 is not None:
    denominator_BHL1 = denominator_BHL1 + jnp.exp(sink_1H11 - m_BHL1)
  p_BHLS = e_BHLS / jnp.where(denominator_BHL1 == 0.0, 1.0, denominator_BHL1)
  p_BHLS = dropout(p_BHLS, call.dropout_rate, call.dropout_key)
  v32_BSHV = v_BSGV.astype(jnp.float32)[:, :, group_H]
  o_BLHV = jnp.einsum("bhls,bshv->blhv", p_BHLS, v32_BSHV)
  return o_BLHV.astype(q_BLHK.dtype)


def _piecewise_logits(q_BLHK, k_BSGK, qpos_BL, kpos_BS, call: AttentionCall, group_H):
  """Unscaled float32 logits [B, H, L, S] of each pair under the piece covering it, and which
  pairs some piece covers [B, L, S]: each piece rotates q and k at its own positions."""
  B, L, H, _ = q_BLHK.shape
  S = k_BSGK.shape[1]
  s_BHLS = jnp.zeros((B, H, L, S), jnp.float32)
  covered_BLS = jnp.zeros((B, L, S), bool)
  for qrot_BL, krot_BS, where_BLS in call.pieces_fn(qpos_BL, kpos_BS):
    q_rot, k_rot = call.rotate_fn(q_BLHK, k_BSGK, qrot_BL, krot_BS)
    piece_BHLS = jnp.einsum(
      "blhk,bshk->bhls", q_rot.astype(jnp.float32), k_rot.astype(jnp.float32)[:, :, group_H]
    )
    s_BHLS = jnp.where(where_BLS[:, None], piece_BHLS, s_BHLS)
    covered_BLS |= where_BLS
  return s_BHLS, covered_BLS
