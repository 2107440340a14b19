"""Decoding caches of softmax attention: slot arithmetic shared by every cache, and the KV cache.

A cache has C slots. Generation writes position p to slot p % C, so a cache with C >= the
generated length is a plain cache and one with C = w is the ring buffer of a sliding window of
w keys (it always holds positions n - w .. n - 1). Generated positions are 0, 1, 2, ... in every
row, so the positions held by the slots follow from the current length n alone and the cache
stores no positions (its bytes per token are the keys' and values' only).

StreamingLLM's attention sinks keep the first n positions in slots 0 .. n - 1 for good and run
the ring over the other C - n slots (position p >= n in slot n + (p - n) % (C - n)); every
function below takes that `sinks` n (0: the plain ring).

Keys are cached rotated, except under a context extension (`posenc.extension`), which rotates
queries and keys per (query, key) pair at each step and so caches them unrotated. A generation
rotates every query and key with one rotary state (`PosEnc.prepare`), prepared from the span of
the whole generation, positions 0 .. P + N - 1 (see `roformer.generate` for why this is the
convention for dynamic NTK), so keys written at different steps stay consistent with each other
and with later queries.

Legend: B batch, L new tokens, C cache slots, G key/value heads, K head dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
  """Keys (rotated, unless a context extension rotates them per piece) and values of one softmax
  layer, [B, C, G, K] each (keys as wide as `rotate` returns them: PoPE's are [B, C, G, 2K]);
  with a forget gate (`forget_gate.py`), c [B, C, H] of each cached key (float32), else None."""

  k_BCGK: jax.Array
  v_BCGK: jax.Array
  c_BCH: jax.Array | None = None


def capacity(window: int, max_len: int, sinks: int = 0) -> int:
  """Slots a layer needs: the window (ring buffer) when it is shorter than the sequence; with
  `sinks` n, n slots more (`window` is then the recent keys kept)."""
  return min(window + sinks, max_len) if window > 0 else max_len


def _slot(pos, num_slots: int, sinks: int):
  # Positions below `sinks` keep their own slot; the others share the ring after them.
  if not sinks:
    return pos % num_slots
  return jnp.where(pos < sinks, pos, sinks + (pos - sinks) % (num_slots - sinks))


def slot_positions(
  length: jax.Array, num_slots: int, sinks: int = 0
) -> tuple[jax.Array, jax.Array]:
  """Positions held by the slots after `length` tokens were written, and which slots hold one.

  Slot i < sinks holds position i; slot i >= sinks holds the latest position p <= length - 1
  with p >= sinks and _slot(p) == i (p % num_slots == i without sinks).

  Returns:
    (int32 [C] positions, bool [C] valid); empty slots have negative positions.
  """
  i_C = jnp.arange(num_slots, dtype=jnp.int32)
  last = jnp.asarray(length, jnp.int32) - 1
  ring = num_slots - sinks
  pos_C = last - jnp.mod(last - i_C, ring)  # (last - p) % ring == (last - sinks - (i - sinks))
  if sinks:
    pos_C = jnp.where(i_C < sinks, jnp.where(i_C <= last, i_C, -1), pos_C)
    pos_C = jnp.where((i_C >= sinks) & (pos_C < sinks), -1, pos_C)
  return pos_C, pos_C >= 0


def write(buf_BC: jax.Array, new_BL: jax.Array, pos_BL: jax.Array, sinks: int = 0) -> jax.Array:
  """Writes new entries [B, L, ...] at positions `pos_BL` (same in every row) to their slots.

  One new entry (a decode step) is a dynamic slice update; several (the prefill, positions
  from 0) are the first min(L, sinks) and the last min(L, C - sinks) entries scattered to their
  slots, since the others would be overwritten anyway.
  """
  C, L = buf_BC.shape[1], new_BL.shape[1]
  new_BL = new_BL.astype(buf_BC.dtype)
  if L == 1:
    slot = _slot(pos_BL[0, 0], C, sinks)
    return jax.lax.dynamic_update_slice_in_dim(buf_BC, new_BL, slot, axis=1)
  m = min(L, C - sinks)
  keep = sorted(set(range(min(L, sinks))) | set(range(L - m, L)))
  return buf_BC.at[:, _slot(pos_BL[0, jnp.asarray(keep)], C, sinks)].set(new_BL[:, keep])


def cache_keys(num_slots: int, pos_BL: jax.Array, sinks: int = 0) -> tuple[jax.Array, jax.Array]:
  """Key positions [B, C] and key segment ids [B, C] (0 = filled, -1 = empty) after a step.

  With query segment ids 0, the segment mask of the kernels hides the empty slots.
  """
  B = pos_BL.shape[0]
  pos_C, valid_C = slot_positions(pos_BL[0, -1] + 1, num_slots, sinks)
  kpos_BC = jnp.broadcast_to(pos_C, (B, num_slots))
  kseg_BC = jnp.broadcast_to(jnp.where(valid_C, 0, -1).astype(jnp.int32), (B, num_slots))
  return kpos_BC, kseg_BC


def nbytes(cache) -> int:
  """Bytes held by a cache pytree (every array leaf)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
