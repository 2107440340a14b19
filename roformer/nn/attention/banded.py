"""Sliding-window self-attention that visits only the key blocks inside the window.

`chunked_attention` hands windowed self-attention here: for each query block the kernel scans
only the key blocks that can hold a key within `window` positions, so time is O(L * (w + block))
and memory O(L * block) instead of a scan over every key block. Which blocks can hold such a key
is decided by index, assuming that within a segment positions advance by at least one per token
(true of every layout here: arange windows, packed documents restarting at 0 in a new segment,
shifted evaluation windows); then a key more than w - 1 indices away is more than w - 1
positions away, or in another segment, and masked anyway. Inside the visited blocks the mask of
`attention_mask` decides exactly, so the result equals the dense kernel's.

Dimension legend as call.py; b is the block, N the number of key blocks visited.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from roformer.nn.attention import primitives, sinks


def visited_blocks(length: int, block: int, window: int, causal: bool) -> int:
  """Key blocks a query block must visit (an upper bound); >= the block count means all."""
  b = min(block, length)
  # Query rows [s, s + b) need keys [s - w + 1, s + b - 1] (causal) or up to s + b + w - 2.
  span = b + (window - 1) * (1 if causal else 2)
  return (span - 1) // b + 2


def banded_attention(
  q_BLHK,
  k_BLGK,
  v_BLGK,
  qpos_BL,
  kpos_BL,
  *,
  qseg_BL=None,
  kseg_BS=None,
  causal: bool = False,
  window: int,
  window_kind: str = "sliding",
  bias_fn=None,
  dropout_rate: float = 0.0,
  dropout_key=None,
  block: int = 512,
  sink_H=None,
  key_bias_BSH=None,
):
  """Self-attention (S = L) under a sliding window w > 0; arguments as `chunked_attention`.

  Query blocks run in a fori_loop writing over the queries in place (as `chunked_attention`);
  for each, a scan visits N = `visited_blocks` key blocks starting at the block of index
  start - w + 1, and a block index outside [0, nk) is masked out entirely.
  """
  B, L, H, K = q_BLHK.shape
  G, V = k_BLGK.shape[2], v_BLGK.shape[3]
  R = H // G
  if k_BLGK.shape[1] != L:
    raise ValueError(f"banded attention is self-attention: {L} queries but {k_BLGK.shape[1]} keys")
  b = min(block, L)
  nb = -(-L // b)
  n_visit = min(visited_blocks(L, block, window, causal), nb)
  if qseg_BL is None:
    qseg_BL = kseg_BS = jnp.zeros((B, L), jnp.int32)
  # [nb, B, b, ...]; padded keys are excluded by `kvalid`.
  kbias = () if key_bias_BSH is None else (key_bias_BSH,)  # sliced only when there is one
  k_blocks = tuple(
    primitives.split_blocks(x, b)
    for x in (k_BLGK, v_BLGK, kpos_BL, kseg_BS, jnp.ones((B, L), bool), *kbias)
  )

  @jax.checkpoint
  def query_block(qi, start, q_BbHK, qpos_Bb, qseg_Bb):
    q_BbGRK = primitives.split_heads(q_BbHK, G)
    first = jnp.floor_divide(start - (window - 1), b)

    def key_block(carry, j):
      ki = first + j
      inside = (ki >= 0) & (ki < nb)
      k_BbGK, v_BbGK, kpos_Bb, kseg_Bb, kvalid_Bb, *kbias_BbH = (
        jax.lax.dynamic_index_in_dim(x, jnp.clip(ki, 0, nb - 1), 0, keepdims=False)
        for x in k_blocks
      )
      mask_BbBb = primitives.attention_mask(
        qpos_Bb, kpos_Bb, qseg_Bb, kseg_Bb, causal=causal, window=window, window_kind=window_kind
      )
      mask_B11bb = (mask_BbBb & kvalid_Bb[:, None, :] & inside)[:, None, None]
      bias = None if bias_fn is None else bias_fn(qpos_Bb, kpos_Bb)
      bias = primitives.add_key_bias(bias, kbias_BbH[0] if kbias_BbH else None, b)
      key = None
      if dropout_key is not None:
        key = jax.random.fold_in(jax.random.fold_in(dropout_key, qi), ki)
      carry = primitives.online_softmax_update(
        carry, q_BbGRK, k_BbGK, v_BbGK, mask_B11bb, bias, dropout_rate=dropout_rate,
        dropout_key=key,
      )  # fmt: skip
      return carry, None

    init = primitives.online_softmax_init(B, G, R, b, V, sinks.grouped(sink_H, G))
    carry, _ = jax.lax.scan(jax.checkpoint(key_block), init, jnp.arange(n_visit))
    return primitives.online_softmax_output(carry, q_BLHK.dtype)

  return primitives.for_each_query_block(query_block, q_BLHK, qpos_BL, qseg_BL, block, value_dim=V)
