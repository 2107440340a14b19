"""Perplexity against context length: blockwise scoring of the evaluation windows.

Every length scores the same span of tokens (`data.eval_windows`; docs/design.md, "Evaluation");
the loss of a window is computed over sequence blocks, so a long window never holds its [L, V]
logits at once.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.data import EvalWindows, eval_windows
from roformer.posenc import randomized as randomized_positions

# Tokens per evaluation batch when --batch_size is 0 (windows per batch = this // length).
AUTO_BATCH_TOKENS = 16384


# ---- Blockwise scoring ----


def loss_block_size(model, length: int) -> int:
  """Sequence block of the blockwise loss: the model's attention block, at most `length`."""
  return max(1, min(model.cfg.attention_block, length))


@functools.partial(jax.jit, static_argnames=("graphdef", "block"))
def score_batch(
  graphdef, state, inputs_BL, targets_BL, positions_BL, weights_BL, segment_ids_BL=None, *, block
):
  """Weighted loss sums of one batch; the output layer and loss run over sequence blocks.

  A fori_loop slices one block of the hidden states at a time (no reshaped or padded copy of
  them), so only [B, block, V] logits ever exist.

  Args:
    graphdef, state: the model, as split by `nnx.split` (graphdef static).
    inputs_BL, targets_BL, positions_BL: int32 [B, L].
    weights_BL: float32 [B, L]; 0 = not scored.
    segment_ids_BL: int32 [B, L] document ids (attention stays within one), or None.
    block: sequence block of the output layer and loss (static).

  Returns:
    (loss_sum, correct_sum, weight_sum) float32 scalars and the loss sum by position, float32 [L].
  """
  model = nnx.merge(graphdef, state)
  h_BLD = model.hidden(inputs_BL, positions_BL, segment_ids_BL=segment_ids_BL, deterministic=True)
  length = h_BLD.shape[1]
  targets_BL = targets_BL.astype(jnp.int32)
  weights_BL = weights_BL.astype(jnp.float32)

  def block_loss(i, carry):
    loss_sum, correct_sum, position_loss_L = carry
    # The last block is shifted back to end at L; positions before i * block were done already.
    start = jnp.minimum(i * block, length - block)
    h_BCD = jax.lax.dynamic_slice_in_dim(h_BLD, start, block, axis=1)
    t_BC = jax.lax.dynamic_slice_in_dim(targets_BL, start, block, axis=1)
    w_BC = jax.lax.dynamic_slice_in_dim(weights_BL, start, block, axis=1)
    new_C = start + jnp.arange(block) >= i * block
    scored_BC = (w_BC > 0) & new_C[None, :]
    logits_BCV = model.logits(h_BCD).astype(jnp.float32)
    logz_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_logit_BC = jnp.take_along_axis(logits_BCV, t_BC[:, :, None], axis=-1)[:, :, 0]
    nll_BC = jnp.where(scored_BC, (logz_BC - target_logit_BC) * w_BC, 0.0)
    correct_BC = jnp.where(scored_BC, (jnp.argmax(logits_BCV, axis=-1) == t_BC) * w_BC, 0.0)
    old_C = jax.lax.dynamic_slice_in_dim(position_loss_L, start, block)
    position_loss_L = jax.lax.dynamic_update_slice_in_dim(
      position_loss_L, old_C + nll_BC.sum(axis=0), start, axis=0
    )
    return loss_sum + nll_BC.sum(), correct_sum + correct_BC.sum(), position_loss_L

  zero = jnp.zeros((), jnp.float32)
  loss_sum, correct_sum, position_loss_L = jax.lax.fori_loop(
    0, -(-length // block), block_loss, (zero, zero, jnp.zeros((length,), jnp.float32))
  )
  return loss_sum, correct_sum, weights_BL.sum(), position_loss_L


@dataclasses.dataclass(frozen=True)
class Scores:
  """Sums over all windows, accumulated in float64.

  Attributes:
    loss_sum, correct_sum, weight_sum: weighted sums of NLL, correct predictions and weights.
    position_loss_sum: float64 [L] weighted NLL summed by position in the window.
    position_weight_sum: float64 [L] weights summed by position in the window.
  """

  loss_sum: float
  correct_sum: float
  weight_sum: float
  position_loss_sum: np.ndarray
  position_weight_sum: np.ndarray


def score_windows(
  model,
  windows: EvalWindows,
  *,
  batch_size: int,
  progress: Callable[[int, int], None] | None = None,
) -> Scores:
  """Scores windows in batches of `batch_size` (the last batch padded with zero-weight rows).

  Args:
    model: an Encoder or Decoder (`hidden` and `logits`).
    windows: EvalWindows [N, L].
    batch_size: windows per jitted call (at most the number of windows); every call has this
      shape, so one compile per length.
    progress: called as progress(windows_done, num_windows) after each batch.

  Returns:
    Scores summed over all windows.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  num_windows, length = windows.inputs.shape
  # Fewer windows than a batch: a smaller batch, not rows of padding.
  batch_size = max(1, min(batch_size, num_windows))
  graphdef, state = nnx.split(model)
  block = loss_block_size(model, length)
  totals = np.zeros(3, np.float64)
  position_loss = np.zeros(length, np.float64)

  def collect(pending):
    out, done = pending
    loss_sum, correct_sum, weight_sum, position_loss_L = jax.device_get(out)
    totals[:] += np.array([loss_sum, correct_sum, weight_sum], np.float64)
    position_loss[:] += np.asarray(position_loss_L, np.float64)
    if progress is not None:
      progress(done, num_windows)

  pending = None
  for start in range(0, num_windows, batch_size):
    rows = np.arange(start, start + batch_size)
    real = rows < num_windows
    rows = np.where(real, rows, 0)
    weights = windows.weights[rows] * real[:, None].astype(np.float32)
    out = score_batch(
      graphdef,
      state,
      windows.inputs[rows],
      windows.targets[rows],
      windows.positions[rows],
      weights,
      None if windows.segment_ids is None else windows.segment_ids[rows],
      block=block,
    )
    # Dispatch this batch before pulling the previous one to host.
    if pending is not None:
      collect(pending)
    pending = (out, min(start + batch_size, num_windows))
  if pending is not None:
    collect(pending)
  return Scores(
    loss_sum=float(totals[0]),
    correct_sum=float(totals[1]),
    weight_sum=float(totals[2]),
    position_loss_sum=position_loss,
    position_weight_sum=windows.weights.astype(np.float64).sum(axis=0),
  )


def score_windows_at_positions(
  model,
  windows: EvalWindows,
  *,
  batch_size: int,
  randomize_max: int = 0,
  seed: int = 0,
  draws: int = randomized_positions.EVAL_DRAWS,
  progress: Callable[[int, int], None] | None = None,
) -> tuple[Scores, list[float]]:
  """`score_windows` at the positions the run was trained with.

  A run trained with randomized positions (`randomize_max` > 0) is scored `draws` times, each
  window (each packed document) at a fresh sorted random subset of [0, randomize_max) of its own
  length; the scores are summed over the draws, so the loss of `summarize` is their mean.

  Returns:
    (scores, the loss of each draw; [] for consecutive positions).
  """
  if not randomize_max:
    return score_windows(model, windows, batch_size=batch_size, progress=progress), []
  if draws < 1:
    raise ValueError(f"--position_draws must be >= 1, got {draws}")
  num_windows, length = windows.positions.shape
  total, losses = None, []
  for draw in range(draws):
    positions = randomized_positions.randomize_positions(
      jnp.asarray(windows.positions),
      None if windows.segment_ids is None else jnp.asarray(windows.segment_ids),
      max_position=randomize_max,
      key=randomized_positions.eval_key(seed, draw, length),
    )
    drawn = dataclasses.replace(windows, positions=np.asarray(positions, np.int32))
    scores = score_windows(
      model,
      drawn,
      batch_size=batch_size,
      progress=None
      if progress is None
      else (lambda done, _, d=draw: progress(d * num_windows + done, draws * num_windows)),
    )
    losses.append(scores.loss_sum / max(scores.weight_sum, 1e-30))
    total = scores if total is None else _add_scores(total, scores)
  return total, losses


def _add_scores(a: Scores, b: Scores) -> Scores:
  return Scores(
    *(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True))
  )


def summarize(scores: Scores, *, model_kind: str, num_tokens: int) -> dict:
  """The metrics dict of `evaluate_at_length` from summed scores."""
  if scores.weight_sum <= 0:
    raise ValueError("no scored tokens: the evaluation span is empty (check max_tokens)")
  loss = scores.loss_sum / scores.weight_sum
  result = {
    "loss": loss,
    "ppl": math.exp(loss) if loss < 700 else math.inf,
    "tokens": int(num_tokens),
    "loss_sum": scores.loss_sum,
    "weight_sum": scores.weight_sum,
  }
  if model_kind == "encoder":
    result["accuracy"] = scores.correct_sum / scores.weight_sum
  return result


def evaluate_at_length(
  model,
  tokens,
  *,
  length: int,
  protocol: str,
  stride: int,
  max_tokens: int,
  max_length: int,
  batch_size: int,
  tokenizer=None,
  mlm_probability: float = 0.15,
  seed: int = 0,
  packed: bool = False,
  randomize_max: int = 0,
  draws: int = randomized_positions.EVAL_DRAWS,
  progress: Callable[[int, int], None] | None = None,
) -> dict:
  """Loss and perplexity of `model` on the evaluation span with windows of `length`.

  The training loop's periodic evaluation is this function with length = max_length = seq_len,
  protocol "nonoverlapping", stride = seq_len and max_tokens = train.eval_max_tokens.

  Args:
    model: an Encoder or Decoder (next-token loss, or masked-token loss and accuracy).
    tokens: int [T] token stream of the split.
    length: window length L.
    protocol: "nonoverlapping" or "sliding" (windows ending every `stride`, scoring their last
      `stride` tokens).
    stride: sliding stride (ignored by "nonoverlapping").
    max_tokens: scored span, rounded by `data.eval_windows` to a multiple of `max_length`.
    max_length: the largest length evaluated; the span starts after a prefix this long.
    batch_size: windows per jitted call.
    tokenizer, mlm_probability, seed: the encoder's deterministic BERT masking.
    packed: the run was trained with `data.pack` (see `data.eval_windows`).
    randomize_max: the run's posenc.randomize_max: > 0 scores at randomized positions as in
      training (`score_windows_at_positions`, seeded by `seed`, averaged over `draws`).
    progress: called as progress(windows_done, num_windows).

  Returns:
    {"loss", "ppl", "tokens", "loss_sum", "weight_sum"} (+ "accuracy" for encoders); loss is the
    weighted mean NLL in nats, tokens the number of scored targets.
  """
  windows, scores, _ = score_at_length(
    model, tokens, length=length, protocol=protocol, stride=stride, max_tokens=max_tokens,
    max_length=max_length, batch_size=batch_size, tokenizer=tokenizer,
    mlm_probability=mlm_probability, seed=seed, packed=packed, randomize_max=randomize_max,
    draws=draws, progress=progress,
  )  # fmt: skip
  return summarize(scores, model_kind=model.cfg.kind, num_tokens=windows.num_tokens)


def score_at_length(model, tokens, *, length, protocol, stride, max_tokens, max_length,
                    batch_size, tokenizer=None, mlm_probability=0.15, seed=0, packed=False,
                    randomize_max=0, draws=randomized_positions.EVAL_DRAWS,
                    progress=None) -> tuple[EvalWindows, Scores, list[float]]:  # fmt: skip
  """The windows of `length` and `model`'s scores on them (arguments as `evaluate_at_length`),
  with each draw's loss when scored at randomized positions (else [])."""
  windows = eval_windows(
    tokens,
    model_kind=model.cfg.kind,
    length=length,
    protocol=protocol,
    stride=stride,
    max_tokens=max_tokens,
    max_length=max_length,
    tokenizer=tokenizer,
    mlm_probability=mlm_probability,
    seed=seed,
    packed=packed,
  )
  scores, draw_losses = score_windows_at_positions(
    model,
    windows,
    batch_size=batch_size,
    randomize_max=randomize_max,
    seed=seed,
    draws=draws,
    progress=progress,
  )
  return windows, scores, draw_losses
