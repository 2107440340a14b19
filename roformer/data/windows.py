"""Evaluation windows: the same scored span of targets, cut into windows of any length.

Target index t means predicting tokens[t] from tokens[:t]. The span is T targets starting after a
prefix of `max_length` tokens, so the windows of every length <= max_length have their full
context available and score exactly the same targets, each exactly once.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from roformer.errors import DataError

log = logging.getLogger(__name__)

PROTOCOLS = ("nonoverlapping", "sliding")


@dataclasses.dataclass(frozen=True)
class EvalWindows:
  """Windows over the scored span; W windows of `length` tokens.

  Attributes:
    inputs: int32 [W, length] tokens[t - 1] for each target index t.
    targets: int32 [W, length] tokens[t].
    positions: int32 [W, length] 0..length-1 in every window.
    weights: float32 [W, length] 1 where the target is scored (each span target exactly once).
    target_indices: int64 [W, length] the target index t of every slot.
    num_tokens: number of scored targets T (== weights.sum()).
    span_start, span_end: the scored targets are [span_start, span_end).
  """

  inputs: np.ndarray
  targets: np.ndarray
  positions: np.ndarray
  weights: np.ndarray
  target_indices: np.ndarray
  num_tokens: int
  span_start: int = 0
  span_end: int = 0


def right_context(max_length: int, *, centred: bool) -> int:
  """Tokens kept after the scored span: half the longest window when windows are centred."""
  return (max_length + 1) // 2 if centred else 0


def span_length(num_available: int, *, max_tokens: int, max_length: int) -> int:
  """T: max_tokens rounded down to a multiple of max_length (at least one), capped by the data."""
  wanted = max(1, max_tokens // max_length) * max_length
  available = (num_available - max_length) // max_length * max_length
  if available < max_length:
    raise DataError(
      f"evaluation at max_length={max_length} needs {2 * max_length} tokens (a {max_length}-token "
      f"prefix and {max_length} targets) but the split has {num_available} tokens; evaluate "
      f"shorter lengths or use a longer split"
    )
  if wanted > available:
    log.warning(
      "The split holds %d tokens: scoring %d targets instead of max_tokens=%d.",
      num_available,
      available,
      max_tokens,
    )
    return available
  return wanted


def eval_windows(
  tokens: np.ndarray,
  *,
  length: int,
  protocol: str,
  stride: int,
  max_tokens: int,
  max_length: int,
  centred: bool = False,
) -> EvalWindows:
  """Cuts the scored span of `tokens` into next-token windows of `length`.

  The span is targets [max_length, max_length + T), T = `max_tokens` rounded down to a multiple of
  `max_length` (at least one), shrunk with a warning to what the split holds. "nonoverlapping"
  tiles windows of `length` over it; "sliding" puts a window ending at every multiple of `stride`
  after the span start, scoring only its last `stride` targets. When `length` (or `stride`) does
  not divide T, the last window is shifted back to end at the span end and scores only targets not
  yet scored. With stride == length both protocols return identical arrays.

  `centred` (bidirectional encoders) puts the scored `stride` targets of a sliding window in its
  middle, so each has (length - stride) / 2 tokens of context on either side rather than none on
  the right; the split then keeps `right_context(max_length)` tokens after the span for every
  length, so that the span, and the tokens any window reads, do not depend on the length.

  Args:
    tokens: int [N] the split's tokens.
    length: window length, 1..max_length.
    protocol: "nonoverlapping" or "sliding".
    stride: sliding: targets scored per window, 1..length (ignored by "nonoverlapping").
    max_tokens: requested number of scored targets.
    max_length: the largest length of the evaluation (sets the prefix and the rounding of T).
    centred: sliding windows score their middle `stride` targets (encoders).

  Returns:
    EvalWindows with arrays [W, length].

  Raises:
    DataError: a bad protocol, length or stride, or a split shorter than 2 * max_length tokens.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
  if protocol not in PROTOCOLS:
    raise DataError(f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
  if not 1 <= length <= max_length:
    raise DataError(f"length={length} must be in [1, max_length={max_length}]")
  if protocol == "sliding" and not 1 <= stride <= length:
    raise DataError(f"stride={stride} must be in [1, length={length}] for sliding windows")
  if max_tokens < 1:
    raise DataError(f"max_tokens={max_tokens} must be >= 1")
  after = right_context(max_length, centred=centred)
  num_targets = span_length(len(tokens) - after, max_tokens=max_tokens, max_length=max_length)
  span_start, span_end = max_length, max_length + num_targets
  scored = length if protocol == "nonoverlapping" else stride
  first_W = span_start + scored * np.arange(-(-num_targets // scored), dtype=np.int64)
  end_W = np.minimum(first_W + scored, span_end)  # each window's targets end here (exclusive)
  if centred and protocol == "sliding":
    start_W = first_W - (length - scored) // 2
  else:
    start_W = end_W - length
  target_indices_WL = start_W[:, None] + np.arange(length, dtype=np.int64)
  weights_WL = (
    (target_indices_WL >= first_W[:, None]) & (target_indices_WL < end_W[:, None])
  ).astype(np.float32)
  return EvalWindows(
    inputs=np.asarray(tokens[target_indices_WL - 1], dtype=np.int32),
    targets=np.asarray(tokens[target_indices_WL], dtype=np.int32),
    positions=np.broadcast_to(np.arange(length, dtype=np.int32), target_indices_WL.shape).copy(),
    weights=weights_WL,
    target_indices=target_indices_WL,
    num_tokens=num_targets,
    span_start=span_start,
    span_end=span_end,
  )
