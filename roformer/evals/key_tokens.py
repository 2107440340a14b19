"""Key-token perplexity (LongPPL; Fang et al. 2024, "What is Wrong with Perplexity for
Long-context Language Modeling?", arXiv 2410.23771): perplexity over the tokens that need the
long context, `eval.py --key_tokens [--key_short_window=K]`.

A target x_i is a key token when the long context makes it much more likely and likely in
absolute terms:

  LSD(x_i) = log p(x_i | long context) - log p(x_i | short context) > LSD_THRESHOLD = 2
  LCL(x_i) = log p(x_i | long context) > LCL_THRESHOLD = -2

(the paper's alpha = 2 and beta = -2; its code, PKU-ML/LongPPL `find_key_token`, keeps
`(loss_short - loss_full) > 2 and loss_full < 2`, strict inequalities), and the key-token
perplexity is exp of the mean long-context loss over the key tokens. The contexts, at window
length L (the non-overlapping windows of the perplexity evaluation, so the long context of the
target at slot p of a window is its p + 1 inputs):

  short   as the paper's: a short window of K tokens (`--key_short_window`, default a quarter
          of the training length; the paper's 4096) and chunks of S = max(1, K // 4) targets
          (the paper's 1024 for 4096) sharing one truncated input; target i of a chunk sees the
          K + i inputs before it (i < S), read by the model as a sequence of its own (positions
          from 0). The last chunk's input is moved back to end at L, so its targets see at most
          K + S - 1 inputs too.
  key tokens are sought from slot K + S on: the paper's first chunk (slots K .. K + S - 1) has
          the same input in both passes (its truncation starts at the document's start), so its
          LSD is 0 and none of it can be a key token.

Where this differs from the paper:
- Here the run's own model scores both passes. The paper picks the key tokens with a separate,
  fixed evaluator model (a large one such as Qwen2-72B-Instruct, or Llama-3.1-8B) and then
  scores every evaluated model on those same tokens. With the model as its own evaluator, the
  key tokens differ from run to run and from length to length, and every key token has a
  long-context loss under 2 nats by the LCL condition, so the key-token perplexity is at most
  e^2 = 7.39 by construction: read it with the number of key tokens (`count`, `fraction` of the
  candidates), which says how many targets the model predicts much better with its whole window
  than with K tokens.
- The long context is one evaluation window of L tokens, not a whole document, and the
  perplexity is over every key token of the span (the paper's code averages per document).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.data import EvalWindows
from roformer.data.windows import document_segments
from roformer.evals.perplexity import AUTO_BATCH_TOKENS, loss_block_size

LSD_THRESHOLD = 2.0  # the paper's alpha: log-probability gain from the long context, nats
LCL_THRESHOLD = -2.0  # the paper's beta: log-probability under the long context
CHUNK_DIVISOR = 4  # S = K // 4, the paper's 4096 / 1024
EVALUATOR = (
  "the run's own model scores both passes (LongPPL's paper picks key tokens with a separate "
  "evaluator model); key-token perplexity is then at most e^2 by the LCL condition"
)


def chunk_size(short_window: int) -> int:
  """S: targets sharing one truncated input."""
  return max(1, short_window // CHUNK_DIVISOR)


# ---- Per-token losses ----


@functools.partial(jax.jit, static_argnames=("graphdef", "block"))
def token_nll(graphdef, state, inputs_BL, targets_BL, positions_BL, segment_ids_BL=None, *, block):
  """Next-token NLL float32 [B, L] of every slot; the output layer runs over sequence blocks
  (only [B, block, V] logits exist), as perplexity.score_batch."""
  model = nnx.merge(graphdef, state)
  h_BLD = model.hidden(inputs_BL, positions_BL, segment_ids_BL=segment_ids_BL, deterministic=True)
  length = h_BLD.shape[1]

  def block_nll(i, nll_BL):
    start = jnp.minimum(i * block, length - block)  # the last block ends at L
    h_BCD = jax.lax.dynamic_slice_in_dim(h_BLD, start, block, axis=1)
    t_BC = jax.lax.dynamic_slice_in_dim(targets_BL.astype(jnp.int32), start, block, axis=1)
    logits_BCV = model.logits(h_BCD).astype(jnp.float32)
    target_BC = jnp.take_along_axis(logits_BCV, t_BC[:, :, None], axis=-1)[:, :, 0]
    nll_BC = jax.nn.logsumexp(logits_BCV, axis=-1) - target_BC
    return jax.lax.dynamic_update_slice_in_dim(nll_BL, nll_BC, start, axis=1)

  zeros_BL = jnp.zeros(targets_BL.shape, jnp.float32)
  return jax.lax.fori_loop(0, -(-length // block), block_nll, zeros_BL)


def _nll_of_rows(model, inputs, targets, positions, segment_ids, *, batch_size: int) -> np.ndarray:
  """token_nll of N rows [N, L] in batches (the last one filled with repeats, then dropped)."""
  num, length = inputs.shape
  batch_size = max(1, min(batch_size, num))
  graphdef, state = nnx.split(model)
  block = loss_block_size(model, length)
  out = np.zeros((num, length), np.float32)
  for start in range(0, num, batch_size):
    rows = np.arange(start, start + batch_size) % num
    nll = token_nll(
      graphdef, state, inputs[rows], targets[rows], positions[rows],
      None if segment_ids is None else segment_ids[rows], block=block,
    )  # fmt: skip
    keep = min(batch_size, num - start)
    out[start : start + keep] = np.asarray(nll)[:keep]
  return out


# ---- The short pass ----


def short_windows(length: int, short_window: int) -> tuple[np.ndarray, np.ndarray]:
  """Where the short pass reads and scores, in slots of a window of `length`.

  Returns:
    (starts int64 [J]: the first input slot of each truncated input of K + S - 1 slots,
     scored bool [J, length]: the slots (targets) each one scores; every slot from K + S on is
     scored by exactly one), J = 0 when length <= K + S.
  """
  K, S = short_window, chunk_size(short_window)
  span = K + S - 1
  chunk_starts = np.arange(K + S, length, S)  # the first slot of chunks j = 1, 2, ...
  starts = np.minimum(chunk_starts - K + 1, length - span)  # target i of a chunk sees K + i
  slots = np.arange(length)
  scored = (slots >= chunk_starts[:, None]) & (slots < chunk_starts[:, None] + S)
  return starts.astype(np.int64), scored


def long_and_short_nll(
  model, windows: EvalWindows, *, short_window: int, eos_id: int | None = None,
  batch_tokens: int = AUTO_BATCH_TOKENS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
  """Both passes' losses of every candidate target (slot >= K + S with weight > 0).

  Args:
    model: a Decoder.
    windows: non-overlapping EvalWindows [W, L] of the perplexity evaluation.
    short_window: K.
    eos_id: the EOS id of a run trained with packing (its truncated inputs get segment ids and
      per-document positions, as `eval_windows` gives the long ones); None otherwise.
    batch_tokens: tokens per forward pass.

  Returns:
    (long_nll float32 [C], short_nll float32 [C], target_indices int64 [C]) over the C candidates,
    in window order.
  """
  W, L = windows.inputs.shape
  starts_J, scored_JL = short_windows(L, short_window)
  candidate_WL = (windows.weights > 0) & (np.arange(L) >= short_window + chunk_size(short_window))
  long_WL = _nll_of_rows(
    model, windows.inputs, windows.targets, windows.positions, windows.segment_ids,
    batch_size=batch_tokens // L,
  )  # fmt: skip
  short_WL = np.full((W, L), np.nan, np.float32)
  if len(starts_J):
    span = short_window + chunk_size(short_window) - 1
    gather_JT = starts_J[:, None] + np.arange(span)  # truncated input j reads these slots
    inputs = windows.inputs[:, gather_JT].reshape(-1, span)  # [W * J, span]
    targets = windows.targets[:, gather_JT].reshape(-1, span)
    if eos_id is None:
      segment_ids, positions = None, np.broadcast_to(np.arange(span, dtype=np.int32), inputs.shape)
    else:
      segment_ids, positions = document_segments(inputs, eos_id)
    nll = _nll_of_rows(
      model, inputs, targets, np.ascontiguousarray(positions), segment_ids,
      batch_size=batch_tokens // span,
    ).reshape(W, len(starts_J), span)  # fmt: skip
    for j, start in enumerate(starts_J.tolist()):
      slots = np.flatnonzero(scored_JL[j])
      short_WL[:, slots] = nll[:, j, slots - start]
  return long_WL[candidate_WL], short_WL[candidate_WL], windows.target_indices[candidate_WL]


# ---- Selection and summary ----


def select_key_tokens(long_nll, short_nll, *, lsd_threshold: float = LSD_THRESHOLD,
                      lcl_threshold: float = LCL_THRESHOLD) -> np.ndarray:  # fmt: skip
  """bool [C]: LSD = short_nll - long_nll > lsd_threshold and LCL = -long_nll > lcl_threshold."""
  long_nll, short_nll = np.asarray(long_nll, np.float64), np.asarray(short_nll, np.float64)
  return (short_nll - long_nll > lsd_threshold) & (-long_nll > lcl_threshold)


def summarize(long_nll, short_nll, **thresholds) -> dict:
  """{"candidates", "count", "fraction", "loss", "ppl", "short_loss"}: the key tokens among the
  candidates and their mean long-context loss (LongPPL = exp of it) and short-context loss;
  loss, ppl and short_loss are None without key tokens."""
  key = select_key_tokens(long_nll, short_nll, **thresholds)
  count, candidates = int(key.sum()), int(len(key))
  loss = float(np.mean(np.asarray(long_nll, np.float64)[key])) if count else None
  short = float(np.mean(np.asarray(short_nll, np.float64)[key])) if count else None
  return {
    "candidates": candidates,
    "count": count,
    "fraction": count / candidates if candidates else None,
    "loss": loss,
    "ppl": None if loss is None else math.exp(loss),
    "short_loss": short,
  }


def key_token_record(model, windows: EvalWindows, *, short_window: int,
                     eos_id: int | None = None, **thresholds) -> dict:  # fmt: skip
  """The "key_tokens" entry of a non-overlapping record of length L (`summarize`)."""
  long_nll, short_nll, _ = long_and_short_nll(
    model, windows, short_window=short_window, eos_id=eos_id
  )
  return summarize(long_nll, short_nll, **thresholds)


def settings(short_window: int) -> dict:
  """The JSON's top-level "key_tokens": how key tokens were chosen."""
  return {
    "short_window": short_window,
    "chunk": chunk_size(short_window),
    "lsd_threshold": LSD_THRESHOLD,
    "lcl_threshold": LCL_THRESHOLD,
    "protocol": "nonoverlapping",
    "evaluator": EVALUATOR,
  }
