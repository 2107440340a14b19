"""Softmax attention without dropout over query blocks, with a hand-written backward pass: the
core of the dense kernel (`kernels/dense.py`).

Operands are heads first: q [B, G, R, L, K], keys and values [B, G, S, K] (legend in
call.py). `attend_spans` runs query blocks over key prefixes, with any mask; causal
self-attention in equal blocks with no other mask has its own arrangement (`block_pairs.py`).

The softmax. The forward pass normalises after the probability-value product (o = (e v) / l
with e = exp(logits - max) and l its row sum), so the probabilities are never written; the
backward pass uses the output (sum_s p dp = do . o) instead of a second reduction over the
scores, and needs no mask (e is exactly 0 where masked). Equal to jax.nn.softmax's forward and
gradients to float32 rounding, except that a row with every key masked gives zeros (as
`dense_attention` returns for it) rather than uniform weights.

With sink logits sink_GR (`sinks.py`), the row max also covers the sink and l gains
exp(sink - max), a key with no value. Its gradient: o = (e v) / l depends on the sink only
through l, d l / d sink = exp(sink - max), so d o / d sink = -o p_sink with
p_sink = exp(sink - max) / l, and d loss / d sink = -sum over batch and rows of p_sink (do . o),
the same do . o that the logits' gradient uses. The logits' gradient keeps its form,
p (dp - do . o): the sink adds no term to sum_s p dp, having no value.
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


def _attend_fwd(q_BGRLK, k_BGSK, v_BGSK, mask_BLS, bias_BGRLS, sink_GR):
  scale = 1.0 / math.sqrt(q_BGRLK.shape[-1])
  if bias_BGRLS is None:
    # The logits unscaled: the scale enters the exponentials' pass, and the row max as a
    # positive factor (rounding is monotonic, so max(s) * scale is max(s * scale) exactly), so
    # no pass writes the scaled [L, S] logits. A masked logit is NEG * scale, still exp -> 0.
    s_BGRLS = rows_einsum("bgmk,bgsk->bgms", q_BGRLK, k_BGSK)
    if mask_BLS is not None:
      s_BGRLS = masked(s_BGRLS, mask_BLS)
  else:
    s_BGRLS, scale = logits(q_BGRLK, k_BGSK, mask_BLS, bias_BGRLS), 1.0
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
  ev_BGRLK = rows_einsum("bgms,bgsk->bgmk", e_BGRLS.astype(v_BGSK.dtype), v_BGSK)
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
  dp_BGRLS = rows_einsum("bgmk,bgsk->bgms", do_BGRLK.astype(v_BGSK.dtype), v_BGSK)
  # d logits = p (dp - sum_s p dp), with p = e / l and sum_s p dp = do . o.
  delta_BGRL1 = jnp.sum(do_BGRLK * o_BGRLK, axis=-1, keepdims=True)
  ds_BGRLS = e_BGRLS * (dp_BGRLS - delta_BGRL1) * r_BGRL1
  # The 1 / sqrt(K) of the logits scales the [L, K] and [S, K] products, not the [L, S] one.
  dq_BGRLK = rows_einsum("bgms,bgsk->bgmk", ds_BGRLS.astype(k_BGSK.dtype), k_BGSK)
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
def attend_spans(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans):
  """softmax attention without dropout over query blocks (the module docstring's softmax).

  `spans` are (start, end, keys) in order, the last over every key (`causal_query_blocks`, or
  one span (0, L, S)): the rows [start, end) of q attend to the keys [0, keys) with their mask
  and bias (`masked`); the outputs are joined along L. One custom_vjp for all blocks, so the
  backward pass adds each block's key and value gradients into their prefix of one [S, K]
  buffer in place, instead of padding every block's to S and summing the padded copies (what
  autodiff of the key slices gives).
  """
  return _spans_fwd(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans)[0]


def _spans_fwd(q_BGRLK, k_BGSK, v_BGSK, masks, biases, sink_GR, spans):
  outputs, residuals = [], []
  for (start, end, keys), mask_BTE, bias_BGRTE in zip(spans, masks, biases, strict=True):
    o_BGRTK, res = _attend_fwd(
      q_BGRLK[:, :, :, start:end], k_BGSK[:, :, :keys], v_BGSK[:, :, :keys], mask_BTE,
      bias_BGRTE, sink_GR,
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


attend_spans.defvjp(_spans_fwd, _spans_bwd)
