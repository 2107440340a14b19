"""Position-wise functions over sequence blocks, written in place (the long-sequence layers).

Dimension legend: B batch, L length, C block.
"""

import jax
import jax.numpy as jnp


def fold(key, i):
  """fold_in(key, i), or None for no key (no dropout)."""
  return None if key is None else jax.random.fold_in(key, i)


def seqwise(fn, *xs_BL, block, key=None):
  """Applies a position-wise `fn(key, *xs)` over blocks of L, writing over the last input.

  `fn` must return an array of the last input's shape and dtype. For L > block, a fori_loop reads
  block i of every input and writes the result over block i of the last input, which no later
  block reads: XLA then updates that buffer in place. (A lax.map would stack the results into a
  fresh [B, L, ...] buffer per call, and XLA on CPU allocates those for every layer up front.)
  Intermediates of `fn` (e.g. the MLP's [B, L, F]) exist for one block at a time. When L is not a
  multiple of block, the last block is shifted back to end at L and keeps the positions already
  written. Block i gets the dropout key fold_in(key, i).

  Args:
    fn: (key or None, *blocks [B, C, ...]) -> [B, C, ...] shaped like the last block.
    *xs_BL: [B, L, ...] arrays; the last one is overwritten block by block.
    block: sequence block C.
    key: dropout key, or None.

  Returns:
    fn applied at every position, shaped like the last input.
  """
  L = xs_BL[0].shape[1]
  if L <= block:
    return fn(key, *xs_BL)
  *ins_BL, out_BL = xs_BL

  def body(i, out_BL):
    start = jnp.minimum(i * block, L - block)
    ins_BC = [jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in ins_BL]
    old_BC = jax.lax.dynamic_slice_in_dim(out_BL, start, block, axis=1)
    new_BC = fn(fold(key, i), *ins_BC, old_BC)
    if L % block:
      done_C = start + jnp.arange(block) < i * block
      new_BC = jnp.where(done_C.reshape((1, block) + (1,) * (old_BC.ndim - 2)), old_BC, new_BC)
    return jax.lax.dynamic_update_slice_in_dim(out_BL, new_BC, start, axis=1)

  return jax.lax.fori_loop(0, -(-L // block), body, out_BL)
