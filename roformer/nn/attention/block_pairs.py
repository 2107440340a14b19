"""Causal self-attention in N equal blocks, keys major: the dense kernel's path for causal
attention with no other mask (`kernels/dense.py`).

q, k and v come laid out [N, B, G, (R,) T, K]: a block is one slice of its stacked array, so
every key is written into the blocks' layout once (a prefix per query block would copy the first
keys again for every later block). Query block i attends to key blocks 0..i; only the diagonal
pair (i, i) is masked, the keys of earlier blocks being earlier (the assumption
`causal_query_blocks` states).

Every product is a plain [rows, inner] x [inner, cols] GEMM: the scores of a pair are computed
transposed, s^T = k q^T [T keys, M = R T queries], so the softmax reduces over the keys axis,
and the backward pass takes the forward pass's blocks as they are:

  forward   s^T = k (q^T)          o^T = (v^T) e^T
  backward  dp = do (v^T)          dq = ds k       dk^T = (q^T) ds       dv = e^T (do / l)

with q^T and v^T written once per block, and ds written rows major from e^T. On XLA:CPU a
batched product that contracts its left operand over the major axis (ds^T q, e^T do in the
rows-major layout) runs at about half the speed of the plain form
(`benchmarks/attention_products.py`).

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
  o [B, G, M, V] and the residuals."""
  B, G, R, T, K = q_BGRTK.shape
  M = R * T
  scale = 1.0 / math.sqrt(K)
  if len({bias is None for _, _, _, bias in key_blocks}) > 1:
    raise ValueError("every pair has a bias, or none: the scale is applied once for all")
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
  has_bias = None if key_blocks[0][3] is None else ()  # every pair's, or none: no array kept
  psink_BG1M = None if sink_GR is None else esink_BG1M / l_BG1M
  o_BGMV = _swap(oT_BGVM)
  return o_BGMV, (qT_BGKM, eT_blocks, l_BG1M, o_BGMV, has_bias, psink_BG1M)


def _query_block_bwd(residuals, kv_blocks, do_BGMV):
  """dq [B, G, M, K], a list of (dk^T [B, G, K, T], dv [B, G, T, V], d bias [B, G, M, T]) per
  key block of `kv_blocks` (the forward pass's k [B, G, T, K] and v^T [B, G, V, T]), and the
  sink logits' gradient per query [B, G, M, 1] (or None).

  The backward products take the forward pass's operands as they are, so no block is copied
  into another layout: dp = do v^T and dq = ds k as [M, T] x [T, K]; dk^T = q^T ds and
  dv = e^T (do / l), each a plain GEMM. Only ds is written rows major, read from e^T."""
  qT_BGKM, eT_blocks, l_BG1M, o_BGMV, has_bias, psink_BG1M = residuals
  scale = 1.0 / math.sqrt(qT_BGKM.shape[2])
  r_BGM1 = _swap(1.0 / l_BG1M)
  # d logits = p (dp - sum_s p dp), with p = e / l and sum_s p dp = do . o.
  delta_BGM1 = jnp.sum(do_BGMV * o_BGMV, axis=-1, keepdims=True)
  v_dtype = kv_blocks[0][1].dtype  # do and do / l in the values' dtype
  dov_BGMV, dor_BGMV = do_BGMV.astype(v_dtype), (do_BGMV * r_BGM1).astype(v_dtype)
  dq_BGMK, grads = None, []
  for (k_BGEK, vT_BGVE), eT_BGEM in zip(kv_blocks, eT_blocks, strict=True):
    dp_BGME = _nn("bgmv,bgvs->bgms", dov_BGMV, vT_BGVE)
    ds_BGME = _swap(eT_BGEM) * (dp_BGME - delta_BGM1) * r_BGM1
    dq = _nn("bgms,bgsk->bgmk", ds_BGME.astype(k_BGEK.dtype), k_BGEK)
    dq_BGMK = dq if dq_BGMK is None else dq_BGMK + dq
    # The 1 / sqrt(K) of the logits scales the [M, K] and [T, K] products, not the [M, T] one.
    dkT_BGKE = _nn("bgkm,bgms->bgks", qT_BGKM, ds_BGME.astype(qT_BGKM.dtype)) * scale
    dv_BGEV = _nn("bgsm,bgmv->bgsv", eT_BGEM.astype(v_dtype), dor_BGMV).astype(v_dtype)
    grads.append((dkT_BGKE.astype(k_BGEK.dtype), dv_BGEV, None if has_bias is None else ds_BGME))
  # The sink logits' gradient is -sum over batch and rows of p_sink (do . o); per query here.
  dsink_BGM1 = None if psink_BG1M is None else -_swap(psink_BG1M) * delta_BGM1
  return dq_BGMK * scale, grads, dsink_BGM1


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
  k_blocks = [k_NBGTK[j] for j in range(n)]
  vT_blocks = [_swap(v_NBGTV[j]) for j in range(n)]
  bias_of = dict(zip(pairs(n), biases, strict=True))
  outputs, residuals = [], []
  for i in range(n):
    key_blocks = [
      (k_blocks[j], vT_blocks[j], _swap(masks[i]) if j == i else None,
       _keys_major_bias(bias_of[i, j]))
      for j in range(i + 1)
    ]  # fmt: skip
    o_BGMV, res = _query_block_fwd(q_NBGRTK[i], key_blocks, sink_GR)
    outputs.append(o_BGMV.reshape(B, G, R, T, -1))
    residuals.append(res)
  # The backward pass reuses the forward pass's blocks (the same arrays, not new slices).
  return jnp.stack(outputs), (k_blocks, vT_blocks, residuals)


def _pairs_bwd(saved, do_NBGRTV):
  k_blocks, vT_blocks, residuals = saved
  n, B, G, R, T, _ = do_NBGRTV.shape
  dq_blocks, dkT_blocks, dv_blocks, dbiases, dsink_GR = [], [None] * n, [None] * n, [], None
  for i in range(n):
    do_BGMV = do_NBGRTV[i].astype(jnp.float32).reshape(B, G, R * T, -1)
    kv_blocks = list(zip(k_blocks[: i + 1], vT_blocks[: i + 1], strict=True))
    dq_BGMK, grads, dsink_BGM1 = _query_block_bwd(residuals[i], kv_blocks, do_BGMV)
    q_dtype = residuals[i][0].dtype
    dq_blocks.append(dq_BGMK.reshape(B, G, R, T, -1).astype(q_dtype))
    for j, (dkT, dv, dbias_BGME) in enumerate(grads):
      dkT_blocks[j] = dkT if dkT_blocks[j] is None else dkT_blocks[j] + dkT
      dv_blocks[j] = dv if dv_blocks[j] is None else dv_blocks[j] + dv
      if dbias_BGME is not None:  # [B, G, R, T, E], the bias's layout
        dbias_BGME = dbias_BGME.reshape(B, G, R, T, -1)
      dbiases.append(dbias_BGME)
    if dsink_BGM1 is not None:
      dsink = dsink_BGM1.reshape(B, G, R, T).sum(axis=(0, 3))
      dsink_GR = dsink if dsink_GR is None else dsink_GR + dsink
  dq_NBGRTK, dkT_NBGKT, dv_NBGTV = (jnp.stack(x) for x in (dq_blocks, dkT_blocks, dv_blocks))
  return dq_NBGRTK, _swap(dkT_NBGKT), dv_NBGTV, (None,) * n, tuple(dbiases), dsink_GR


attend_pairs.defvjp(_pairs_fwd, _pairs_bwd)
