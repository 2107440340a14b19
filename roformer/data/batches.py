"""Training batches: a pure function of (seed, step, process_index) over a cached token array.

Decoder rows are seq_len + 1 consecutive tokens (windows overlap by one token, so every token is
a target once per epoch) split into inputs and next-token targets; with data.pack, documents are
packed with segment ids instead, and only those batches carry segment ids. Encoder rows are plain
windows of seq_len tokens of the token stream (documents separated by EOS, no CLS/SEP),
BERT-masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from roformer.data.config import DataConfig
from roformer.data.masking import mlm_mask
from roformer.data.packing import gather_rows, plan_packing
from roformer.errors import DataError

if TYPE_CHECKING:  # a Corpus builds its TrainBatches: no runtime import back
  from roformer.data.corpus import Corpus

MODEL_KINDS = ("decoder", "encoder")
# First entries of the seed sequences, so window order and masking draw independent streams.
_ORDER_STREAM, _MASK_STREAM = 0, 1


class TrainBatches:
  """Batches of the training split; `batch(step)` depends only on (seed, step, process_index).

  Epoch e visits every window once, in the order
  `np.random.default_rng((seed, 0, e)).permutation(num_windows)`; global row g of step s is
  element s * global_batch_size + g of the concatenated epochs. Process p builds only rows
  [p * local, (p + 1) * local) with local = global_batch_size // process_count, so the processes
  together produce exactly the global batch. The iterator state is the step: restoring the step
  restores the stream. Encoder masks are drawn from `default_rng((seed, 1, step, global_row))`.

  Args:
    corpus: the tokenized corpus.
    cfg: the data config (seq_len, pack, mlm_probability).
    model_kind: "decoder" (next-token targets) or "encoder" (BERT-masked inputs).
    global_batch_size: rows per step over all processes.
    seed: the data seed (window order and masks).
    process_index: which slice of the global batch this process builds.
    process_count: number of slices; must divide global_batch_size.
    split: the corpus split to draw from.

  Attributes:
    num_windows: rows per epoch (windows, or packed rows with data.pack).
    local_batch_size: rows returned by `batch`.
  """

  def __init__(
    self,
    corpus: Corpus,
    cfg: DataConfig,
    *,
    model_kind: str,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
  ):
    if model_kind not in MODEL_KINDS:
      raise DataError(f"model.kind={model_kind!r} is not one of {', '.join(MODEL_KINDS)}")
    if global_batch_size < 1 or global_batch_size % process_count:
      raise DataError(
        f"train.global_batch_size={global_batch_size} must be a positive multiple of the "
        f"process count {process_count}"
      )
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    if cfg.seq_len < 1:
      raise DataError(f"data.seq_len={cfg.seq_len} must be >= 1")
    if model_kind == "encoder" and not 0.0 < cfg.mlm_probability < 1.0:
      raise DataError(f"data.mlm_probability={cfg.mlm_probability} must be in (0, 1)")
    self.cfg = cfg
    self.tokenizer = corpus.tokenizer
    self.model_kind = model_kind
    self.seq_len = cfg.seq_len
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.seed = seed
    self.process_index = process_index
    self._tokens = corpus.tokens(split)
    self._packed = model_kind == "decoder" and cfg.pack
    self._plan = None
    n = len(self._tokens)
    if self._packed:
      self._plan = plan_packing(self._tokens, eos_id=self.tokenizer.eos_id, row_len=cfg.seq_len + 1)
      self.num_windows = self._plan.num_rows
      needed = 2  # any document of two tokens gives a row
    elif model_kind == "decoder":
      self.num_windows = (n - 1) // cfg.seq_len
      needed = cfg.seq_len + 1
    else:
      self.num_windows = n // cfg.seq_len
      needed = cfg.seq_len
    if n < needed or self.num_windows < 1:
      raise DataError(
        f"data.seq_len={cfg.seq_len}: a {model_kind} window needs {needed} tokens but the {split} "
        f"split of {corpus.source.describe()} has only {n} tokens"
      )
    self._perms: dict[int, np.ndarray] = {}
    # The parts of a batch that do not depend on the step, built once: batch() runs every step.
    self._local_rows_B = process_index * self.local_batch_size + np.arange(
      self.local_batch_size, dtype=np.int64
    )
    self._offsets_R = np.arange(cfg.seq_len + (model_kind == "decoder"))
    self._positions_BL = np.broadcast_to(
      np.arange(cfg.seq_len, dtype=np.int32), (self.local_batch_size, cfg.seq_len)
    )

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of the global batch of `step`.

    Returns:
      {"inputs", "targets", "positions"}: int32 [B, L] and "weights": float32 [B, L], with
      B = global_batch_size // process_count and L = data.seq_len; packed rows (data.pack) add
      "segment_ids" int32 [B, L]. Decoder targets are the next tokens (packed: weight 0 on targets
      in another document or padding; padding has segment id 0). Encoder inputs are masked,
      targets are the original tokens, weights 1 on masked positions.
    """
    if step < 0:
      raise ValueError(f"step={step} must be >= 0")
    windows_B = self._windows(step * self.global_batch_size + self._local_rows_B)
    if self._packed:
      return self._packed_batch(windows_B)
    if self.model_kind == "decoder":
      return self._decoder_batch(windows_B)
    return self._encoder_batch(windows_B, step=step)

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yields batch(start_step), batch(start_step + 1), ... (resume by passing the saved step)."""
    step = start_step
    while True:
      yield self.batch(step)
      step += 1

  def _windows(self, rows_B: np.ndarray) -> np.ndarray:
    epoch_B, index_B = np.divmod(rows_B, self.num_windows)
    windows_B = np.empty_like(rows_B)
    for epoch in np.unique(epoch_B).tolist():
      at = epoch_B == epoch
      windows_B[at] = self._permutation(epoch)[index_B[at]]
    return windows_B

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._perms:
      if len(self._perms) >= 4:  # a batch spans at most a few epochs
        self._perms.pop(next(iter(self._perms)))
      rng = np.random.default_rng((self.seed, _ORDER_STREAM, epoch))
      self._perms[epoch] = rng.permutation(self.num_windows)
    return self._perms[epoch]

  def _decoder_batch(self, windows_B: np.ndarray) -> dict[str, np.ndarray]:
    rows_BR = np.asarray(self._tokens[windows_B[:, None] * self.seq_len + self._offsets_R])
    return self._window_batch(
      np.ascontiguousarray(rows_BR[:, :-1], dtype=np.int32),
      np.ascontiguousarray(rows_BR[:, 1:], dtype=np.int32),
      np.ones(self._positions_BL.shape, np.float32),
    )

  def _window_batch(
    self, inputs_BL: np.ndarray, targets_BL: np.ndarray, weights_BL: np.ndarray
  ) -> dict[str, np.ndarray]:
    """A batch of unpacked windows: positions 0..L-1 and no segment ids. A row is one sequence,
    so attention needs no segment mask: the fused kernels (cuDNN's causal kernel, splash) then
    run unmasked, and no all-ones array is built and sent to the devices every step."""
    return {
      "inputs": inputs_BL,
      "targets": targets_BL,
      "positions": self._positions_BL.copy(),  # fresh arrays: callers may mutate or donate them
      "weights": weights_BL,
    }

  def _packed_batch(self, windows_B: np.ndarray) -> dict[str, np.ndarray]:
    tokens_BR, segment_ids_BR, positions_BR = gather_rows(
      self._tokens, self._plan, windows_B, pad_id=self.tokenizer.pad_id
    )
    segment_ids_BL = segment_ids_BR[:, :-1]
    # A target counts only inside its input's document (not the next one, not padding).
    weights_BL = (segment_ids_BR[:, 1:] == segment_ids_BL) & (segment_ids_BL > 0)
    return {
      "inputs": np.ascontiguousarray(tokens_BR[:, :-1]),
      "targets": np.ascontiguousarray(tokens_BR[:, 1:]),
      "positions": np.ascontiguousarray(positions_BR[:, :-1]),
      "segment_ids": np.ascontiguousarray(segment_ids_BL),
      "weights": weights_BL.astype(np.float32),
    }

  def _encoder_batch(self, windows_B: np.ndarray, *, step: int) -> dict[str, np.ndarray]:
    targets_BL = np.asarray(
      self._tokens[windows_B[:, None] * self.seq_len + self._offsets_R], np.int32
    )
    inputs_BL = np.empty_like(targets_BL)
    weights_BL = np.empty(targets_BL.shape, np.float32)
    for i, row in enumerate(self._local_rows_B.tolist()):
      # One generator per global row, so a row's mask does not depend on the process layout.
      rng = np.random.default_rng((self.seed, _MASK_STREAM, step, row))
      inputs_BL[i : i + 1], weights_BL[i : i + 1] = mlm_mask(
        targets_BL[i : i + 1],
        rng=rng,
        tokenizer=self.tokenizer,
        mlm_probability=self.cfg.mlm_probability,
      )
    return self._window_batch(inputs_BL, targets_BL, weights_BL)
