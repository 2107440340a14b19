"""Randomized positional encodings (Ruoss et al. 2023): sorted random positions, in training and at
evaluation alike.

Every sequence of length k takes a sorted random k-subset of [0, N) as its positions (N =
`posenc.randomize_max`), so a model trained on lengths up to L meets the positions of sequences up
to N long. The paper's code (google-deepmind/randomized_positional_encodings,
`models/positional_encodings.py` and `models/transformer.py`) has no train/eval switch: every
forward pass, evaluation included, draws a fresh subset of the sequence's own length. So does this
codebase: training draws from (seed, step), evaluation from (seed, stream, draw, length) and
averages its scores over `EVAL_DRAWS` draws. Feeding 0, 1, 2, ... at evaluation would score the
model at gaps of 1, which its training (mean gap N / L) practically never produced.

A "sequence" is a document: a row of one example (its padding is a sequence of its own) or each
packed document of a row (segment ids). It acts on positions alone, so it works with every
encoding that reads them (a learned table needs posenc.max_len >= N).
"""

import jax
import jax.numpy as jnp

# Folded into the seed's key, so these draws are independent of the dropout keys (which fold the
# step directly into key(seed)); evaluation draws use a stream of their own.
_TRAIN_STREAM = 0x52504F53
_EVAL_STREAM = 0x52504F54
EVAL_DRAWS = 4  # draws of positions each evaluation averages over (the spread is recorded)


def train_key(seed: int, step) -> jax.Array:
  """The key of a training step's draw: a pure function of (seed, step)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _TRAIN_STREAM), step)


def eval_key(seed: int, draw: int, length: int) -> jax.Array:
  """The key of evaluation draw `draw` at (task or window) length `length`."""
  key = jax.random.fold_in(jax.random.key(seed), _EVAL_STREAM)
  return jax.random.fold_in(jax.random.fold_in(key, length), draw)


def document_index(segment_ids_BL: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
  """int32 [B, L]: 0, 0, ..., 1, 1, ...: the index along its row of each token's document.

  A document is a run of equal segment ids (padding, segment 0, is one more); without segment ids
  every row is one document.
  """
  if segment_ids_BL is None:
    return jnp.zeros(shape, jnp.int32)
  change_BL = jnp.concatenate(
    [jnp.zeros((shape[0], 1), bool), segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1]], axis=1
  )
  return jnp.cumsum(change_BL, axis=1, dtype=jnp.int32)


def randomize_positions(
  positions_BL: jax.Array,
  segment_ids_BL: jax.Array | None,
  *,
  max_position: int,
  key: jax.Array,
) -> jax.Array:
  """Each document's positions: a sorted random subset of [0, max_position) of its own length.

  Row b draws one random sequence of L distinct values from [0, N) (the indices of the L largest
  of N uniform draws, in the order of the draws); the document covering tokens [s, s + k) of the
  row takes the values at s..s+k-1, sorted. Those are a uniformly random k-subset of [0, N), so a
  9-token example spans [0, N) like a 65-token one; the documents of one row get disjoint
  subsets. Positions are assumed to count 0, 1, ... from each document's start (as packing and
  the synthetic rows give them); the values returned replace them in that order.

  Args:
    positions_BL: int positions [B, L] (only their dtype is used).
    segment_ids_BL: int document ids [B, L] (0 = padding), or None (every row one document).
    max_position: N >= L.
    key: `train_key` or `eval_key`; the [B, N] draw is over the global batch, so the result does
      not depend on how the batch is sharded.

  Returns:
    int positions [B, L], same dtype, strictly increasing within each document.
  """
  B, L = positions_BL.shape
  if max_position < L:
    raise ValueError(f"posenc.randomize_max={max_position} must be >= the sequence length {L}")
  _, draw_BL = jax.lax.top_k(jax.random.uniform(key, (B, max_position)), L)
  doc_BL = document_index(segment_ids_BL, (B, L))
  # Sorting by (document, value) keeps every document in its own span (documents are contiguous
  # and numbered along the row) and sorts the values within it.
  _, sorted_BL = jax.lax.sort((doc_BL, draw_BL.astype(jnp.int32)), dimension=1, num_keys=2)
  return sorted_BL.astype(positions_BL.dtype)


def protocol(max_position: int, draws: int = EVAL_DRAWS) -> dict:
  """The JSON record of how an evaluation placed its positions."""
  if not max_position:
    return {"kind": "consecutive"}
  return {"kind": "randomized", "max_position": max_position, "draws": draws}
