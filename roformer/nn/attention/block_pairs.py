"""Causal self-attention in N equal blocks, keys major: the dense kernel's path for causal
attention with no other mask (`kernels.dense_attention`).

q, k and v come laid out [N, B, G, (R,) T, K]: every block is a contiguous view, so no key
prefix is copied. Query block i attends to key blocks 0..i; only the diagonal pair (i, i) is
masked, the keys of earlier blocks being earlier (the assumption `causal_query_blocks` states).

Every product is a plain [rows, inner] x [inner, cols] GEMM: the scores of a pair are computed
transposed, s^T = k q^T [T keys, M = R T queries], so the softmax reduces over the keys axis and
the four backward products need no transposed operand either:

  forward   s^T = k (q^T)          o^T = (v^T) e^T
  backward  dp^T = v (do^T)        dq^T = (k^T) ds^T      dk = ds^T q      dv = e^T (do / l)

with the small [T, K] transposes of q, k, v and do written once. On XLA:CPU a batched product
that contracts its left operand over the major axis (ds^T q, e^T do in the row-major layout)
runs at about half the speed of the plain form (`benchmarks/attention_products.py`).
The softmax is `blocks.attend_spans`'s (normalised after the value product, the backward pass
from do . o, the sink logits one more term of each query's denominator), transposed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from roformer.nn.attention.primitives import NEG


def pairs(n: int) -> list[tuple[int, int]]:
  """The (query block, key block) pairs of causal attention in n blocks, in `attend_pairs`'s
  order of biases: (0, 0), (1, 0), (1, 1), (2, 0), ..."""
  return [(i, j) for i in range(n) for j in range(i + 1)]


def _swap(x):
  return jnp.swapaxes(x, -1, -2)


def _nn(spec, x, y):
  return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


def _query_block_fwd(q_BGRTK, key_blocks, sink_GR):
  """Query block q [B, G, R, T, K] over `key_blocks`, a list of (k [B, G, T, K],
  v^T [B, G, V, T], mask^T [B, T keys, T queries] or None, bias^T [B, G, T, M] or None):
  o^T [B, G, V, M] and the residuals."""
  B, G, R, T, K = q_BGRTK.shape
  M = R * T
  scale = 1.0 / math.sqrt(K)
  q_BGMK = q_BGRTK.reshape(B, G, M, K)
  qT_BGKM = _swap(q_BGMK)
  s_blocks = []
  for k_BGEK, _, maskT_BEQ, biasT_BGEM in key_blocks:
    sT_BGEM = _nn("bgsk,bgkm->bgsm", k_BGEK, qT_BGKM)
    if biasT_BGEM is not None:  # the bias is on the scaled logits
      sT_BGEM = sT_BGEM * scale + biasT_BGEM
    if maskT_BEQ is not None:
      E = sT_BGEM.shape[2]
      sT_BGERT = sT_BGEM.reshape(B, G, E, R, T)
      sT_BGEM = jnp.where(maskT_BEQ[:, None, :, None], sT_BGERT, NEG).reshape(B, G, E, M)
    s_blocks.append(sT_BGEM)
  # Without a bias the logits stay unscaled and the scale enters exp and the max (as in
  # `blocks.attend_spans`: max(s) * scale is max(s * scale) exactly).
  scale = 1.0 if key_blocks[0][3] is not None else scale
  max_BG1M = functools.reduce(jnp.maximum, [s.max(axis=2, keepdims=True) for s in s_blocks])
  m_BG1M = max_BG1M * scale
  sink_11GM = None
  if sink_GR is not None:
    sink_11GM = jnp.repeat(sink_GR, T, axis=-1)[None, :, None, :]  # per query head and row
    m_BG1M = jnp.maximum(m_BG1M, sink_11GM)
  else:  # a query with every key masked: e = exp(NEG) = 0, zero output and gradients
    m_BG1M = jnp.where(max_BG1M > NEG, m_BG1M, 0.0)
  eT_blocks = [jnp.exp(s * scale - m_BG1M) for s in s_blocks]
  l_BG1M = functools.reduce(jnp.add, [e.sum(axis=2, keepdims=True) for e in eT_blocks])
  if sink_11GM is not None:
    esink_BG1M = jnp.exp(sink_11GM - m_BG1M)
    l_BG1M = l_BG1M + esink_BG1M
  evT_blocks = [
    _nn("bgks,bgsm->bgkm", vT_BGVE, e.astype(vT_BGVE.dtype))
    for e, (_, vT_BGVE, _, _) in zip(eT_blocks, key_blocks, strict=True)
  ]
  l_BG1M = jnp.where(l_BG1M == 0.0, 1.0, l_BG1M)
  oT_BGVM = functools.reduce(jnp.add, evT_blocks) / l_BG1M
  has_bias = tuple(None if b is None else () for _, _, _, b in key_blocks)  # no array kept
  psink_BG1M = None if sink_GR is None else esink_BG1M / l_BG1M
  return oT_BGVM, (q_BGMK, eT_blocks, l_BG1M, oT_BGVM, has_bias, psink_BG1M)


def _query_block_bwd(residuals, kv_blocks, doT_BGVM):
  """dq^T [B, G, K, M], a list of (dk, dv, d bias^T) per key block of `kv_blocks` (k^T
  [B, G, K, T], v [B, G, T, V]), and the sink logits' gradient per query [B, G, 1, M] (or
  None)."""
  q_BGMK, eT_blocks, l_BG1M, oT_BGVM, has_bias, psink_BG1M = residuals
  scale = 1.0 / math.sqrt(q_BGMK.shape[-1])
  r_BG1M = 1.0 / l_BG1M
  # d logits = p (dp - sum_s p dp), with p = e / l and sum_s p dp = do . o.
  delta_BG1M = jnp.sum(doT_BGVM * oT_BGVM, axis=2, keepdims=True)
  dor_BGMV = _swap(doT_BGVM * r_BG1M)
  dqT_BGKM, grads = None, []
  for (kT_BGKE, v_BGEV), eT_BGEM, bias in zip(kv_blocks, eT_blocks, has_bias, strict=True):
    dpT_BGEM = _nn("bgsk,bgkm->bgsm", v_BGEV, doT_BGVM.astype(v_BGEV.dtype))
    dsT_BGEM = eT_BGEM * (dpT_BGEM - delta_BG1M) * r_BG1M
    dqT = _nn("bgks,bgsm->bgkm", kT_BGKE, dsT_BGEM.astype(kT_BGKE.dtype))
    dqT_BGKM = dqT if dqT_BGKM is None else dqT_BGKM + dqT
    # The 1 / sqrt(K) of the logits scales the [M, K] and [T, K] products, not the [T, M] one.
    dk_BGEK = _nn("bgsm,bgmk->bgsk", dsT_BGEM.astype(q_BGMK.dtype), q_BGMK) * scale
    dv_BGEV = _nn("bgsm,bgmk->bgsk", eT_BGEM.astype(v_BGEV.dtype), dor_BGMV.astype(v_BGEV.dtype))
    dk_BGEK, dv_BGEV = dk_BGEK.astype(kT_BGKE.dtype), dv_BGEV.astype(v_BGEV.dtype)
    grads.append((dk_BGEK, dv_BGEV, None if bias is None else dsT_BGEM))
  # The sink logits' gradient is -sum over batch and rows of p_sink (do . o); per query here.
  dsink_BG1M = None if psink_BG1M is None else -psink_BG1M * delta_BG1M
  return dqT_BGKM * scale, grads, dsink_BG1M


@jax.custom_vjp
def attend_pairs(q_NBGRTK, k_NBGTK, v_NBGTV, masks, biases, sink_GR):
  """Causal self-attention in N equal blocks: query block i over key blocks 0..i. `masks` are
  the N diagonal pairs' [B, T, T] masks (query, key), `biases` one [B, G, R, T, T] bias (or
  None) per pair in the order of `pairs(N)`, sink_GR sink logits (or None). Returns
  [N, B, G, R, T, V], equal to `blocks.attend_spans` over the same blocks to float32 rounding.
  """
  return _pairs_fwd(q_NBGRTK, k_NBGTK, v_NBGTV, masks, biases, sink_GR)[0]


def _keys_major_bias(bias_BGRTE):
  """[B, G, R, T, E] -> [B, G, E, R T] (None stays None)."""
  if bias_BGRTE is None:
    return None
  B, G, R, T, E = bias_BGRTE.shape
  return bias_BGRTE.transpose(0, 1, 4, 2, 3).reshape(B, G, E, R * T)


def _pairs_fwd(q_NBGRTK, k_NBGTK, v_NBGTV, masks, biases, sink_GR):
  n, B, G, R, T, _ = q_NBGRTK.shape
  vT_NBGVT = _swap(v_NBGTV)
  bias_of = dict(zip(pairs(n), biases, strict=True))
  outputs, residuals = [], []
  for i in range(n):
    key_blocks = [
      (k_NBGTK[j], vT_NBGVT[j], _swap(masks[i]) if j == i else None,
       _keys_major_bias(bias_of[i, j]))
      for j in range(i + 1)
    ]  # fmt: skip
    oT_BGVM, res = _query_block_fwd(q_NBGRTK[i], key_blocks, sink_GR)
    outputs.append(_swap(oT_BGVM).reshape(B, G, R, T, -1))
    residuals.append(res)
  return jnp.stack(outputs), (_swap(k_NBGTK), v_NBGTV, residuals)


def _pairs_bwd(saved, do_NBGRTV):
  kT_NBGKT, v_NBGTV, residuals = saved
  n, B, G, R, T, _ = do_NBGRTV.shape
  dq_blocks, dk_blocks, dv_blocks, dbiases, dsink_GR = [], [None] * n, [None] * n, [], None
  for i in range(n):
    doT_BGVM = _swap(do_NBGRTV[i].astype(jnp.float32).reshape(B, G, R * T, -1))
    kv_blocks = [(kT_NBGKT[j], v_NBGTV[j]) for j in range(i + 1)]
    dqT_BGKM, grads, dsink_BG1M = _query_block_bwd(residuals[i], kv_blocks, doT_BGVM)
    q_dtype = residuals[i][0].dtype
    dq_blocks.append(_swap(dqT_BGKM).reshape(B, G, R, T, -1).astype(q_dtype))
    for j, (dk, dv, dbiasT_BGEM) in enumerate(grads):
      dk_blocks[j] = dk if dk_blocks[j] is None else dk_blocks[j] + dk
      dv_blocks[j] = dv if dv_blocks[j] is None else dv_blocks[j] + dv
      if dbiasT_BGEM is not None:  # back to [B, G, R, T, E]
        E = dbiasT_BGEM.shape[2]
        dbiasT_BGEM = dbiasT_BGEM.reshape(B, G, E, R, T).transpose(0, 1, 3, 4, 2)
      dbiases.append(dbiasT_BGEM)
    if dsink_BG1M is not None:
      dsink = dsink_BG1M.reshape(B, G, R, T).sum(axis=(0, 3))
      dsink_GR = dsink if dsink_GR is None else dsink_GR + dsink
  stack = jnp.stack
  return stack(dq_blocks), stack(dk_blocks), stack(dv_blocks), (None,) * n, tuple(dbiases), dsink_GR


attend_pairs.defvjp(_pairs_fwd, _pairs_bwd)
