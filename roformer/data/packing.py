"""Packing documents into fixed-length rows with segment ids and per-document positions.

Documents longer than a row are cut into pieces of `row_len` tokens that overlap by one token,
so that every next-token target inside a document is trained exactly once. Pieces are packed
greedily in corpus order (next fit): a piece that does not fit starts a new row.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackPlan:
  """Where each row's pieces are: row r holds pieces row_ptr[r]:row_ptr[r + 1], in order.

  Attributes:
    row_len: tokens per row (seq_len + 1: inputs and targets are its two shifted views).
    piece_start: int64 [P] index of each piece's first token in the token array.
    piece_len: int64 [P] tokens per piece, 1..row_len.
    row_ptr: int64 [R + 1] offsets into the pieces.
  """

  row_len: int
  piece_start: np.ndarray
  piece_len: np.ndarray
  row_ptr: np.ndarray

  @property
  def num_rows(self) -> int:
    return len(self.row_ptr) - 1


def plan_packing(tokens: np.ndarray, *, eos_id: int, row_len: int) -> PackPlan:
  """Cuts `tokens` (documents each ending with EOS) into pieces and packs them into rows.

  Args:
    tokens: int [N] documents, each followed by `eos_id`.
    eos_id: the document separator (kept as the last token of its document).
    row_len: tokens per row, >= 2.

  Returns:
    The PackPlan.
  """
  n = len(tokens)
  ends_D = np.flatnonzero(np.asarray(tokens) == eos_id)
  if len(ends_D) == 0 or ends_D[-1] != n - 1:
    ends_D = np.append(ends_D, n - 1)  # trailing tokens without EOS form a last document
  starts_D = np.concatenate([[0], ends_D[:-1] + 1])
  lengths_D = ends_D - starts_D + 1
  step = row_len - 1
  pieces_D = np.maximum(1, -(-(lengths_D - 1) // step))
  doc_P = np.repeat(np.arange(len(pieces_D)), pieces_D)
  k_P = np.arange(len(doc_P)) - np.repeat(np.cumsum(pieces_D) - pieces_D, pieces_D)
  piece_start = starts_D[doc_P] + k_P * step
  piece_len = np.minimum(row_len, ends_D[doc_P] + 1 - piece_start)
  row_ptr = [0]
  used = 0
  for i, length in enumerate(piece_len.tolist()):
    if used + length > row_len:
      row_ptr.append(i)
      used = 0
    used += length
  row_ptr.append(len(piece_len))
  return PackPlan(
    row_len=row_len,
    piece_start=piece_start.astype(np.int64),
    piece_len=piece_len.astype(np.int64),
    row_ptr=np.asarray(row_ptr, dtype=np.int64),
  )


def gather_rows(
  tokens: np.ndarray, plan: PackPlan, rows_B: np.ndarray, *, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Materialises packed rows.

  Args:
    tokens: int [N] the token array the plan was made from.
    plan: the PackPlan.
    rows_B: int [B] row indices.
    pad_id: token of unused row slots.

  Returns:
    (tokens_BR int32, segment_ids_BR int32 (1, 2, ... per piece; 0 = padding),
     positions_BR int32 (0 at each piece's start; 0 on padding)), R = plan.row_len.
  """
  rows_B = np.asarray(rows_B, dtype=np.int64)
  b, r = len(rows_B), plan.row_len
  first_B = plan.row_ptr[rows_B]
  count_B = plan.row_ptr[rows_B + 1] - first_B
  base_B = np.cumsum(count_B) - count_B  # first piece of each row in the gathered piece list
  piece_Q = np.repeat(first_B - base_B, count_B) + np.arange(count_B.sum())
  row_Q = np.repeat(np.arange(b), count_B)
  seg_Q = np.arange(len(piece_Q)) - np.repeat(base_B, count_B) + 1
  len_Q = plan.piece_len[piece_Q]
  start_Q = np.cumsum(len_Q) - len_Q  # in the concatenation of all gathered pieces
  offset_Q = start_Q - np.repeat(start_Q[base_B], count_B)  # every row has at least one piece
  # Token-level view: token j of piece q goes to (row_Q[q], offset_Q[q] + j).
  q_T = np.repeat(np.arange(len(piece_Q)), len_Q)
  within_T = np.arange(len(q_T)) - np.repeat(start_Q, len_Q)
  out_rows, out_cols = row_Q[q_T], offset_Q[q_T] + within_T
  tokens_BR = np.full([b, r], pad_id, dtype=np.int32)
  segment_ids_BR = np.zeros([b, r], dtype=np.int32)
  positions_BR = np.zeros([b, r], dtype=np.int32)
  tokens_BR[out_rows, out_cols] = tokens[plan.piece_start[piece_Q][q_T] + within_T]
  segment_ids_BR[out_rows, out_cols] = seg_Q[q_T]
  positions_BR[out_rows, out_cols] = within_T
  return tokens_BR, segment_ids_BR, positions_BR
