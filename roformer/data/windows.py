"""Evaluation windows: the same scored span of targets, cut into windows of any length.

Target index t means predicting tokens[t] from tokens[:t]. The span is T targets starting after a
prefix of `max_length` tokens, so the windows of every length <= max_length have their full
context available and score exactly the same targets, each exactly once. `eval_windows` returns
the model's final inputs for both objectives: next-token windows for decoders, BERT-masked
windows for encoders, since the masking lives in `data` as well.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from roformer.data.batches import MODEL_KINDS
from roformer.data.masking import mlm_mask
from roformer.data.tokenizer import Tokenizer
from roformer.errors import DataError

log = logging.getLogger(__name__)

PROTOCOLS = ("nonoverlapping", "sliding")


@dataclasses.dataclass(frozen=True)
class EvalWindows:
  """Model inputs for one length and protocol over the scored span; W windows of `length` tokens.

  Attributes:
    inputs: int32 [W, length] tokens the model reads: tokens[t - 1] for each target index t
      (decoders), or the BERT-masked tokens[t] (encoders).
    targets: int32 [W, length] tokens[t].
    positions: int32 [W, length] 0..length-1 in every window, or the position within each
      document (decoders trained with packing).
    weights: float32 [W, length] 1 where the target is scored: each span target exactly once
      (decoders), the masked ones among them (encoders).
    target_indices: int64 [W, length] the target index t of every slot.
    num_tokens: number of scored targets (== weights.sum()).
    span_start, span_end: the span's targets are [span_start, span_end).
    segment_ids: int32 [W, length] document ids within each window (decoders trained with
      packing), or None.
  """

  inputs: np.ndarray
  targets: np.ndarray
  positions: np.ndarray
  weights: np.ndarray
  target_indices: np.ndarray
  num_tokens: int
  span_start: int
  span_end: int
  segment_ids: np.ndarray | None = None


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
  model_kind: str = "decoder",
  tokenizer: Tokenizer | None = None,
  mlm_probability: float = 0.15,
  seed: int = 0,
  packed: bool = False,
) -> EvalWindows:
  """Cuts the scored span of `tokens` into the model's windows of `length`.

  The span is targets [max_length, max_length + T), T = `max_tokens` rounded down to a multiple of
  `max_length` (at least one), shrunk with a warning to what the split holds. "nonoverlapping"
  tiles windows of `length` over it; "sliding" puts a window ending at every multiple of `stride`
  after the span start, scoring only its last `stride` targets. When `length` (or `stride`) does
  not divide T, the last window is shifted back to end at the span end and scores only targets not
  yet scored. With stride == length both protocols return identical arrays.

  Decoders read the previous token of every target; a run trained with packing (`packed`) gets
  segment ids and per-document positions, as in training, so no token attends across a document
  boundary. Encoders read the span's tokens themselves, BERT-masked (`_mask_encoder_windows`),
  and their sliding windows are centred: the scored `stride` targets sit in the middle, with
  (length - stride) / 2 tokens of context on either side rather than none on the right; the split
  then keeps `right_context(max_length)` tokens after the span for every length, so that the
  span, and the tokens any window reads, do not depend on the length.

  Args:
    tokens: int [N] the split's tokens (documents joined with EOS).
    length: window length, 1..max_length.
    protocol: "nonoverlapping" or "sliding".
    stride: sliding: targets scored per window, 1..length (ignored by "nonoverlapping").
    max_tokens: requested number of scored targets.
    max_length: the largest length of the evaluation (sets the prefix and the rounding of T).
    model_kind: "decoder" (next-token windows) or "encoder" (masked, centred windows).
    tokenizer: the run's Tokenizer (encoders: mask and special token ids; packed: the EOS id).
    mlm_probability: fraction of tokens masked (encoders).
    seed: seed of the mask (encoders).
    packed: the run was trained with `data.pack` (decoders).

  Returns:
    EvalWindows with arrays [W, length].

  Raises:
    DataError: a bad model kind, protocol, length or stride, or a split shorter than
      2 * max_length tokens.
  """
  if model_kind not in MODEL_KINDS:
    raise DataError(f"model.kind={model_kind!r} is not one of {', '.join(MODEL_KINDS)}")
  tokens = np.asarray(tokens)
  encoder = model_kind == "encoder"
  windows = _span_windows(
    tokens,
    length=length,
    protocol=protocol,
    stride=stride,
    max_tokens=max_tokens,
    max_length=max_length,
    centred=encoder,
  )
  if encoder:
    if tokenizer is None:
      raise ValueError("evaluating an encoder (model.kind='encoder') needs the run's tokenizer")
    return _mask_encoder_windows(
      windows,
      tokens,
      max_length=max_length,
      tokenizer=tokenizer,
      mlm_probability=mlm_probability,
      seed=seed,
    )
  if packed:
    if tokenizer is None:
      raise ValueError("evaluating a run trained with data.pack needs the run's tokenizer")
    segment_ids, positions = document_segments(windows.inputs, tokenizer.eos_id)
    return dataclasses.replace(windows, positions=positions, segment_ids=segment_ids)
  return windows


def _span_windows(
  tokens: np.ndarray,
  *,
  length: int,
  protocol: str,
  stride: int,
  max_tokens: int,
  max_length: int,
  centred: bool,
) -> EvalWindows:
  """Next-token windows over the span (arguments as `eval_windows`); `centred` sliding windows
  score their middle `stride` targets."""
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
    # A last window with fewer than `stride` targets left would reach past the kept right
    # context (and out of the masked region): it moves back to end there, its targets still
    # inside it, with more context on the left than centring gives.
    start_W = np.minimum(first_W - (length - scored) // 2, span_end + after - length)
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


def _mask_encoder_windows(
  windows: EvalWindows,
  tokens: np.ndarray,
  *,
  max_length: int,
  tokenizer: Tokenizer,
  mlm_probability: float,
  seed: int,
) -> EvalWindows:
  """An encoder's windows: the span's own tokens, BERT-masked, scored where masked.

  The mask is drawn once (seeded) over a region fixed by the span and max_length alone (the
  prefix any window may reach into, the span, the right context of centred windows), so every
  length and protocol scores the same masked tokens.
  """
  # An encoder window is the token span a decoder window scores: its targets, read unshifted.
  index_WL = windows.target_indices
  region_start = max(0, windows.span_start - max_length)
  region_stop = windows.span_end + right_context(max_length, centred=True)
  masked_1R, mask_weights_1R = mlm_mask(
    tokens[None, region_start:region_stop],
    rng=np.random.default_rng(seed),
    tokenizer=tokenizer,
    mlm_probability=mlm_probability,
  )
  in_region_WL = index_WL >= region_start
  offset_WL = np.where(in_region_WL, index_WL - region_start, 0)
  targets_WL = windows.targets
  weights_WL = windows.weights * np.where(
    in_region_WL, np.asarray(mask_weights_1R, np.float32)[0][offset_WL], 0.0
  )
  return dataclasses.replace(
    windows,
    inputs=np.where(in_region_WL, np.asarray(masked_1R)[0][offset_WL], targets_WL).astype(np.int32),
    weights=weights_WL,
    num_tokens=int(np.count_nonzero(weights_WL)),
  )


def document_segments(inputs_WL: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and per-document positions of windows over EOS-joined documents.

  A document ends with its EOS, so a new segment starts after every EOS input. This is what a
  run trained with `data.pack` saw: attention within one document, positions restarting at 0.

  Returns:
    (segment_ids int32 [W, L], positions int32 [W, L]).
  """
  W, L = inputs_WL.shape
  index_WL = np.broadcast_to(np.arange(L, dtype=np.int64), (W, L))
  starts_WL = np.zeros((W, L), bool)
  starts_WL[:, 0] = True
  starts_WL[:, 1:] = inputs_WL[:, :-1] == eos_id
  segment_WL = np.cumsum(starts_WL, axis=1) - 1
  start_index_WL = np.maximum.accumulate(np.where(starts_WL, index_WL, 0), axis=1)
  return segment_WL.astype(np.int32), (index_WL - start_index_WL).astype(np.int32)
