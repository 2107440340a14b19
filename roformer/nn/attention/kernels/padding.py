"""Padding shared by the fused kernels: sequences to a multiple of the kernel's tile (TPU lanes,
the CPU kernel's block), head dims to one width, segment ids that keep padded keys unseen.

Dimension legend as call.py; P the padded sequence length, W the padded head width.
"""

from __future__ import annotations

import jax.numpy as jnp

from roformer.nn.attention.kernels.base import log_once

LANES = 128  # TPU vector lanes: the Pallas TPU kernels' block and head-dim granularity
# Pad head dims to a multiple of LANES: None = where a kernel needs it (tests set True to check the
# padding). Compiled for v4 and v5e, splash takes any head dim (16, 64 and 192 tried); the flash
# kernel takes any up to 128 and multiples of 128 above.
PAD_HEAD_DIM: bool | None = None


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def lane_block(padded: int, block: int) -> int:
  """The largest multiple of LANES that divides `padded` and is at most max(block, LANES)."""
  units = padded // LANES
  best = max(1, min(units, block // LANES))
  while units % best:
    best -= 1
  return best * LANES


def pad_axis(x, axis: int, size: int, value=0):
  """`x` padded with `value` at the end of `axis` to `size`."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def head_width(q_BLHK, v_BSGV, lanes: bool) -> int:
  """W: one width for queries, keys and values (values narrower than PoPE's keys are padded),
  rounded up to a multiple of LANES when `lanes` (or PAD_HEAD_DIM) says so."""
  width = max(q_BLHK.shape[-1], v_BSGV.shape[-1])
  lanes = lanes if PAD_HEAD_DIM is None else PAD_HEAD_DIM
  if lanes and width % LANES:
    log_once(f"attention head dim {width} padded to {round_up(width, LANES)} (TPU lanes)")
  return round_up(width, LANES) if lanes else width


def padded_segments(qseg_BL, kseg_BS, B: int, L: int, S: int, P: int):
  """Segment ids [B, P] of queries and keys, or None when neither padding nor packing needs them.
  Padded keys get -1, which no real query carries (real ids are >= 0), so no real query sees one;
  padded queries see only padded keys (their rows are cut)."""
  if qseg_BL is None and P == L == S:
    return None, None
  qseg_BL = jnp.zeros((B, L), jnp.int32) if qseg_BL is None else qseg_BL.astype(jnp.int32)
  kseg_BS = jnp.zeros((B, S), jnp.int32) if kseg_BS is None else kseg_BS.astype(jnp.int32)
  return pad_axis(qseg_BL, 1, P, -1), pad_axis(kseg_BS, 1, P, -1)
