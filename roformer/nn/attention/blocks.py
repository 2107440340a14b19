"""Softmax attention without dropout over blocks of queries and keys, with a hand-written backward
pass: the core of the dense kernel (`kernels.dense_attention`).

Operands are heads first: q [B, G, R, T, K], keys and values [B, G, E, K] (legend in
kernels.py). One query block attends to a list of key blocks, each with its mask and bias; the
softmax runs over all of them (one row max, one row sum), so splitting the keys changes nothing
beyond float32 rounding. `attend_spans` runs query blocks over key prefixes sliced from
[B, G, S, K] keys, with any mask; causal self-attention in equal blocks has its own arrangement
(`block_pairs.py`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from roformer.nn.attention.primitives import NEG


def rows_einsum(spec, x_BGRL_, y):
  """float32 `jnp.einsum(spec, x, y)` with x's (R, L) merged into one axis M (of x and of the
  output): one free axis per operand, so neither the product nor its transposes need a copy."""
  B, G, R, L = x_BGRL_.shape[:4]
  out = jnp.einsum(spec, x_BGRL_.reshape(B, G, R * L, -1), y, preferred_element_type=jnp.float32)
  return out.reshape(B, G, R, L, -1)


def logits(q_BGRLK, k_BGSK, mask_BLS, bias_BGRLS):
  """q k / sqrt(K) + bias, NEG where masked: [B, G, R, L, S] float32."""
  K = q_BGRLK.shape[-1]
  s_BGRLS = rows_einsum("bgmk,bgsk->bgms", q_BGRLK, k_BGSK) * (1.0 / math.sqrt(K))
  if bias_BGRLS is not None:
    s_BGRLS = s_BGRLS + bias_BGRLS
  if mask_BLS is not None:
    s_BGRLS = masked(s_BGRLS, mask_BLS)
  return s_BGRLS


def masked(s_BGRLS, mask_BLT):
  """NEG where the mask [B, L, T] disallows a key. It covers the last T keys of the logits
  [..., L, S], whose first S - T keys are all allowed; with T < S only those T columns are
  rewritten (in place)."""
  T, S = mask_BLT.shape[-1], s_BGRLS.shape[-1]
  if T == S:
    return jnp.where(mask_BLT[:, None, None], s_BGRLS, NEG)
  tail_BGRLT = jnp.where(mask_BLT[:, None, None], s_BGRLS[..., S - T :], NEG)
  return jax.lax.dynamic_update_slice_in_dim(s_BGRLS, tail_BGRLT, S - T, axis=-1)


def _block_fwd(q_BGRTK, key_blocks, sink_GR):
  """One query block over `key_blocks`, a list of (k [B, G, E, K], v, mask [B, T, E'] or None,
  bias [B, G, R, T, E] or None): the output [B, G, R, T, V] and the backward pass's residuals."""
  scale = 1.0 / math.sqrt(q_BGRTK.shape[-1])
  if key_blocks[0][3] is None:
    # The logits unscaled: the scale enters the exponentials' pass, and the row max as a
    # positive factor (rounding is monotonic, so max(s) * scale is max(s * scale) exactly), so
    # no pass writes the scaled [T, E] logits. A masked logit is NEG * scale, still exp -> 0.
    s_blocks = [rows_einsum("bgmk,bgsk->bgms", q_BGRTK, k) for k, _, _, _ in key_blocks]
    masks = [m for _, _, m, _ in key_blocks]
    s_blocks = [s if m is None else masked(s, m) for s, m in zip(s_blocks, masks, strict=True)]
  else:
    s_blocks = [logits(q_BGRTK, k, m, bias) for k, _, m, bias in key_blocks]
    scale = 1.0
  max_BGRT1 = functools.reduce(jnp.maximum, [s.max(axis=-1, keepdims=True) for s in s_blocks])
  m_BGRT1 = max_BGRT1 * scale
  if sink_GR is not None:
    m_BGRT1 = jnp.maximum(m_BGRT1, sink_GR[None, :, :, None, None])
  else:
    # A row whose every key is masked (its max is NEG) subtracts 0 instead: e = exp(NEG) = 0,
    # so it gives zero output and zero gradients (a per-row fix, not a pass over [T, E]).
    m_BGRT1 = jnp.where(max_BGRT1 > NEG, m_BGRT1, 0.0)
  e_blocks = [jnp.exp(s * scale - m_BGRT1) for s in s_blocks]
  l_BGRT = functools.reduce(jnp.add, [e.sum(axis=-1) for e in e_blocks])
  if sink_GR is not None:  # with a sink, a row with every key masked has l = e_sink = 1, o = 0
    esink_BGRT = jnp.exp(sink_GR[None, :, :, None] - m_BGRT1[..., 0])
    l_BGRT = l_BGRT + esink_BGRT
  ev_blocks = [
    rows_einsum("bgms,bgsk->bgmk", e.astype(v.dtype), v)
    for e, (_, v, _, _) in zip(e_blocks, key_blocks, strict=True)
  ]
  ev_BGRTV = functools.reduce(jnp.add, ev_blocks)
  l_BGRT = jnp.where(l_BGRT == 0.0, 1.0, l_BGRT)
  o_BGRTV = ev_BGRTV / l_BGRT[..., None]
  kv = [(k, v) for k, v, _, _ in key_blocks]
  has_bias = tuple(None if b is None else () for _, _, _, b in key_blocks)  # no array kept
  psink_BGRT = None if sink_GR is None else esink_BGRT / l_BGRT
  return o_BGRTV, (q_BGRTK, kv, e_blocks, l_BGRT, o_BGRTV, has_bias, psink_BGRT)


def _block_bwd(residuals, do_BGRTV):
  """Gradients of `_block_fwd`: dq, a list of (dk, dv, dbias) per key block, dsink."""
  q_BGRTK, kv, e_blocks, l_BGRT, o_BGRTV, has_bias, psink_BGRT = residuals
  B, G, R, T, K = q_BGRTK.shape
  M = R * T
  scale = 1.0 / math.sqrt(K)
  r_BGRT1 = (1.0 / l_BGRT)[..., None]
  do_BGRTV = do_BGRTV.astype(jnp.float32)
  # d logits = p (dp - sum_s p dp), with p = e / l and sum_s p dp = do . o.
  delta_BGRT1 = jnp.sum(do_BGRTV * o_BGRTV, axis=-1, keepdims=True)
  dor_BGMV = (do_BGRTV * r_BGRT1).reshape(B, G, M, -1)
  q_BGMK = q_BGRTK.reshape(B, G, M, K)
  dq_BGRTK, grads = None, []
  for (k_BGEK, v_BGEV), e_BGRTE, bias in zip(kv, e_blocks, has_bias, strict=True):
    dp_BGRTE = rows_einsum("bgmk,bgsk->bgms", do_BGRTV.astype(v_BGEV.dtype), v_BGEV)
    ds_BGRTE = e_BGRTE * (dp_BGRTE - delta_BGRT1) * r_BGRT1
    # The 1 / sqrt(K) of the logits scales the [T, K] and [E, K] products, not the [T, E] one.
    dq = rows_einsum("bgms,bgsk->bgmk", ds_BGRTE.astype(k_BGEK.dtype), k_BGEK)
    dq_BGRTK = dq if dq_BGRTK is None else dq_BGRTK + dq
    dk_BGEK = jnp.einsum(
      "bgms,bgmk->bgsk", ds_BGRTE.reshape(B, G, M, -1).astype(q_BGRTK.dtype), q_BGMK,
      preferred_element_type=jnp.float32,
    )  # fmt: skip
    dv_BGEV = jnp.einsum(
      "bgms,bgmk->bgsk", e_BGRTE.reshape(B, G, M, -1).astype(v_BGEV.dtype),
      dor_BGMV.astype(v_BGEV.dtype), preferred_element_type=jnp.float32,
    )  # fmt: skip
    dk = (dk_BGEK * scale).astype(k_BGEK.dtype)
    grads.append((dk, dv_BGEV.astype(v_BGEV.dtype), None if bias is None else ds_BGRTE))
  dsink_GR = None
  if psink_BGRT is not None:  # -sum over batch and rows of p_sink (do . o)
    dsink_GR = -jnp.sum(psink_BGRT * delta_BGRT1[..., 0], axis=(0, 3))
  return (dq_BGRTK * scale).astype(q_BGRTK.dtype), grads, dsink_GR


_SOFTMAX_DOC = """
  The forward pass normalises after the probability-value product (o = (e v) / l with
  e = exp(logits - max) and l its row sum), so the probabilities are never written; the
  backward pass uses the output (sum_s p dp = do . o) instead of a second reduction over the
  scores, and needs no mask (e is exactly 0 where masked). Equal to jax.nn.softmax's forward
  and gradients to float32 rounding, except that a row with every key masked gives zeros (as
  `dense_attention` returns for it) rather than uniform weights.

  With sink logits sink_GR (`sinks.py`), the row max also covers the sink and l gains
  exp(sink - max), a key with no value. Its gradient: o = (e v) / l depends on the sink only
  through l, d l / d sink = exp(sink - max), so d o / d sink = -o p_sink with
  p_sink = exp(sink - max) / l, and d loss / d sink = -sum over batch and rows of
  p_sink (do . o), the same do . o that the logits' gradient uses. The logits' gradient keeps
  its form, p (dp - do . o): the sink adds no term to sum_s p dp, having no value.
"""


def _add(total, x):
  return x if total is None else total + x


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def attend_spans(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans):
  """`spans` are (start, end, keys) in order, the last over every key (`causal_query_blocks`,
  or one span (0, L, S)): the rows [start, end) of q attend to the keys [0, keys) with their
  mask and bias (`masked`); the outputs are joined along L. One custom_vjp for all blocks, so
  the backward pass adds each block's key and value gradients into their prefix of one [S, K]
  buffer in place, instead of padding every block's to S and summing the padded copies (what
  autodiff of the key slices gives).
  """
  return _spans_fwd(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans)[0]


attend_spans.__doc__ += _SOFTMAX_DOC


def _spans_fwd(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans):
  outputs, residuals = [], []
  for (start, end, keys), mask_BTE, bias_BGRTE in zip(spans, masks, biases, strict=True):
    o_BGRTK, res = _block_fwd(
      q_BGRLK[:, :, :, start:end],
      [(k_BGSK[:, :, :keys], v_BGSK[:, :, :keys], mask_BTE, bias_BGRTE)], sink_GR,
    )  # fmt: skip
    outputs.append(o_BGRTK)
    residuals.append(res)
  return jnp.concatenate(outputs, axis=3), residuals


def _spans_bwd(spans, residuals, do_BGRLK):
  n = len(spans)
  dq_blocks, dbiases, dk_BGSK, dv_BGSK, dsink_GR = [None] * n, [None] * n, None, None, None
  # The last block first: its key and value gradients, over every key, start the [S, K] buffers.
  for i in reversed(range(n)):
    start, end, keys = spans[i]
    dq_blocks[i], [(dk_BGEK, dv_BGEK, dbiases[i])], dsink = _block_bwd(
      residuals[i], do_BGRLK[:, :, :, start:end]
    )
    if dk_BGSK is None:
      dk_BGSK, dv_BGSK = dk_BGEK, dv_BGEK
    else:
      dk_BGSK = dk_BGSK.at[:, :, :keys].add(dk_BGEK)
      dv_BGSK = dv_BGSK.at[:, :, :keys].add(dv_BGEK)
    if dsink is not None:
      dsink_GR = _add(dsink_GR, dsink)
  dq_BGRLK = jnp.concatenate(dq_blocks, axis=3)
  return dq_BGRLK, dk_BGSK, dv_BGSK, (None,) * n, tuple(dbiases), dsink_GR


attend_spans.defvjp(_spans_fwd, _spans_bwd)
