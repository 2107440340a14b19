"""BERT masked-language-model corruption, shared by training batches and encoder evaluation."""

from __future__ import annotations

import math

import numpy as np

from roformer.data.tokenizer import Tokenizer
from roformer.errors import DataError

# Of the selected positions: 80% become [MASK], 10% a random regular token, 10% stay (BERT).
MASK_FRACTION = 0.8
RANDOM_FRACTION = 0.1


def mlm_mask(
  tokens_NL: np.ndarray, *, rng: np.random.Generator, tokenizer: Tokenizer, mlm_probability: float
) -> tuple[np.ndarray, np.ndarray]:
  """Selects positions for the MLM loss and corrupts them as BERT does.

  Each non-special token is selected independently with probability `mlm_probability`; special
  tokens (pad, eos, mask, cls, sep, unk) never are. A selected token becomes the mask token with
  probability 0.8, a uniformly drawn regular (non-special) token with 0.1, and stays with 0.1.
  The draws depend only on `rng` and the shape, so a seeded generator gives a reproducible mask.

  Args:
    tokens_NL: int [N, L] original tokens (the targets).
    rng: the generator to draw from.
    tokenizer: supplies mask_id, the special ids and the regular ids.
    mlm_probability: selection rate, in (0, 1).

  Returns:
    (inputs_NL int32 [N, L] corrupted tokens, weights_NL float32 [N, L]: 1 on selected positions).
  """
  tokens_NL = np.asarray(tokens_NL)
  if tokens_NL.ndim != 2:
    raise ValueError(f"tokens_NL must be [N, L], got shape {tokens_NL.shape}")
  if not 0.0 < mlm_probability < 1.0:
    raise DataError(f"data.mlm_probability={mlm_probability} must be in (0, 1)")
  select_u_NL = rng.random(tokens_NL.shape)
  kind_u_NL = rng.random(tokens_NL.shape)
  regular_V = tokenizer.regular_ids
  random_NL = regular_V[rng.integers(len(regular_V), size=tokens_NL.shape)]
  selected_NL = (select_u_NL < mlm_probability) & ~np.isin(tokens_NL, tokenizer.special_ids)
  inputs_NL = np.where(selected_NL & (kind_u_NL < MASK_FRACTION), tokenizer.mask_id, tokens_NL)
  use_random_NL = (kind_u_NL >= MASK_FRACTION) & (kind_u_NL < MASK_FRACTION + RANDOM_FRACTION)
  inputs_NL = np.where(selected_NL & use_random_NL, random_NL, inputs_NL)
  return inputs_NL.astype(np.int32), selected_NL.astype(np.float32)


def max_predictions(seq_len: int, mlm_probability: float) -> int:
  """Static per-row capacity for the positions `mlm_mask` selects (BERT's max_predictions_per_seq).

  The number selected in a row of L tokens is at most Binomial(L, p): the capacity is its mean
  plus 3 standard deviations, rounded up to a multiple of 8 and at most L. A row with more
  selected positions is rare (about 1 in 700 rows); the train step then scores every position, so
  the loss never depends on the capacity.
  """
  mean = seq_len * mlm_probability
  spread = 3.0 * math.sqrt(seq_len * mlm_probability * (1.0 - mlm_probability))
  return min(seq_len, 8 * math.ceil((mean + spread) / 8))
