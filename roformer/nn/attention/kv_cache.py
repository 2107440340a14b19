"""Decoding caches of softmax attention: slot arithmetic shared by every cache, and the KV cache.

A cache has C slots. Generation writes position p to slot p % C, so a cache with C >= the
generated length is a plain cache and one with C = w is the ring buffer of a sliding window of
w keys (it always holds positions n - w .. n - 1). Generated positions are 0, 1, 2, ... in every
row, so the positions held by the slots follow from the current length n alone and the cache
stores no positions (its bytes per token are the keys' and values' only).

Keys are cached rotated. A generation rotates every query and key with one rotary state
(`PosEnc.prepare`), prepared from the span of the whole generation, positions 0 .. P + N - 1
(see `roformer.generate` for why this is the convention for dynamic NTK), so keys written at
different steps stay consistent with each other and with later queries.

Legend: B batch, L new tokens, C cache slots, G key/value heads, K head dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
  """Keys (rotated) and values of one softmax layer, [B, C, G, K] each; with a forget gate
  (`forget_gate.py`), c [B, C, H] of each cached key (float32), else None."""

  k_BCGK: jax.Array
  v_BCGK: jax.Array
  c_BCH: jax.Array | None = None


def capacity(window: int, max_len: int) -> int:
  """Slots a layer needs: the window (ring buffer) when it is shorter than the sequence."""
  return min(window, max_len) if window > 0 else max_len


def slot_positions(length: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
  """Positions held by the slots after `length` tokens were written, and which slots hold one.

  Slot i holds the latest position p <= length - 1 with p % num_slots == i.

  Returns:
    (int32 [C] positions, bool [C] valid); empty slots have negative positions.
  """
  i_C = jnp.arange(num_slots, dtype=jnp.int32)
  last = jnp.asarray(length, jnp.int32) - 1
  pos_C = last - jnp.mod(last - i_C, num_slots)
  return pos_C, pos_C >= 0


def write(buf_BC: jax.Array, new_BL: jax.Array, pos_BL: jax.Array) -> jax.Array:
  """Writes new entries [B, L, ...] at positions `pos_BL` (same in every row) to slots p % C.

  One new entry (a decode step) is a dynamic slice update; several (the prefill) are the last
  min(L, C) entries scattered to their slots, since earlier ones would be overwritten anyway.
  """
  C, L = buf_BC.shape[1], new_BL.shape[1]
  new_BL = new_BL.astype(buf_BC.dtype)
  if L == 1:
    return jax.lax.dynamic_update_slice_in_dim(buf_BC, new_BL, pos_BL[0, 0] % C, axis=1)
  m = min(L, C)
  return buf_BC.at[:, pos_BL[0, L - m :] % C].set(new_BL[:, L - m :])


def cache_keys(num_slots: int, pos_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Key positions [B, C] and key segment ids [B, C] (0 = filled, -1 = empty) after a step.

  With query segment ids 0, the segment mask of the kernels hides the empty slots.
  """
  B = pos_BL.shape[0]
  pos_C, valid_C = slot_positions(pos_BL[0, -1] + 1, num_slots)
  kpos_BC = jnp.broadcast_to(pos_C, (B, num_slots))
  kseg_BC = jnp.broadcast_to(jnp.where(valid_C, 0, -1).astype(jnp.int32), (B, num_slots))
  return kpos_BC, kseg_BC


def nbytes(cache) -> int:
  """Bytes held by a cache pytree (every array leaf)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
