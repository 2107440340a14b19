"""Randomized positional encodings (Ruoss et al. 2023): random sorted training positions.

Each training sequence of length L takes a sorted random subset of [0, N) as its positions, so
the model meets the positions of sequences up to N long while training only on length L; at
evaluation positions are consecutive again. It acts on the positions alone, so it works with
every encoding (a learned table needs posenc.max_len >= N).
"""

import jax
import jax.numpy as jnp

# Folded into the seed's key before the step, so these draws are independent of the dropout keys
# (which fold the step directly into key(seed)).
_STREAM = 0x52504F53


def randomize_positions(
  positions_BL: jax.Array, *, max_position: int, seed: int, step
) -> jax.Array:
  """Maps position p of row b to the p-th smallest of a random L-subset of [0, max_position).

  Consecutive positions 0..L-1 become a sorted random subset; positions that restart per packed
  document map to increasing prefixes of the same subset, so each document stays in order. The
  draw is a pure function of (seed, step, global row): a resumed run draws the same positions,
  whatever the sharding of the batch.

  Args:
    positions_BL: int positions in [0, L) (the training batch's), [B, L] over the global batch.
    max_position: N >= L.
    seed: the run's seed.
    step: the training step (traced or concrete).

  Returns:
    int positions [B, L], same dtype, strictly increasing along each row (within a document).
  """
  B, L = positions_BL.shape
  if max_position < L:
    raise ValueError(f"posenc.randomize_max={max_position} must be >= the sequence length {L}")
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _STREAM), step)
  # The indices of the L largest of N uniform draws are a uniformly random L-subset.
  _, subset_BL = jax.lax.top_k(jax.random.uniform(key, (B, max_position)), L)
  subset_BL = jnp.sort(subset_BL, axis=1).astype(positions_BL.dtype)
  return jnp.take_along_axis(subset_BL, positions_BL, axis=1)
