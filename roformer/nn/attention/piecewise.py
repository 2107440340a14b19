"""Logits of one block of (query, key) pairs under piecewise positions: each piece rotates the
block's (unrotated) queries and keys at its own positions, and the pair takes the logit of the
piece that covers it.

This is how training-free context extensions (Self-Extend, DCA, ReRoPE, STRING, attention
sinks; `roformer.posenc.extension`) change the relative distance per pair. The dense kernel
calls it on its query spans and the chunked kernel on each (query block, key block), before the
(online) softmax, so the chunked kernel's memory stays O(L * block).

Dimension legend as call.py: B batch, L queries, S keys, H query heads, G key/value heads,
R = H // G, K head dim.
"""

import jax
import jax.numpy as jnp

from roformer.nn.attention.primitives import PiecesFn, RotateFn, scores, split_heads


def pieces_cover(pieces) -> jax.Array:
  """bool [B, L, S]: the pairs some piece covers (the others are masked)."""
  covered_BLS = pieces[0].where_BLS
  for piece in pieces[1:]:
    covered_BLS = covered_BLS | piece.where_BLS
  return covered_BLS


def piecewise_scores(
  q_BLHK, k_BSGK, qpos_BL, kpos_BS, bias_BHLS, *, pieces_fn: PiecesFn, rotate_fn: RotateFn
) -> tuple[jax.Array, jax.Array]:
  """Scaled logits float32 [B, G, R, L, S] and bool covered_BLS (pairs some piece covers).

  Args:
    q_BLHK, k_BSGK: unrotated queries and keys of the block.
    qpos_BL, kpos_BS: their int positions (those the pieces and the bias are computed from).
    bias_BHLS: a positional bias added to every piece's logits, or None.
    pieces_fn: the block's pieces (`posenc.position_pieces`).
    rotate_fn: rotates queries and keys at given positions (`posenc.rotate` with the pass's
      rotary state, so every piece uses the pass's frequencies).
  """
  G = k_BSGK.shape[2]
  pieces = pieces_fn(qpos_BL, kpos_BS)
  s_BGRLS = None
  for qrot_BL, krot_BS, where_BLS in pieces:
    q_rot_BLHK, k_rot_BSGK = rotate_fn(q_BLHK, k_BSGK, qrot_BL, krot_BS)
    piece_BGRLS = scores(split_heads(q_rot_BLHK, G), k_rot_BSGK, bias_BHLS)
    # Pieces are disjoint: the first one's logits stand wherever no later piece covers.
    s_BGRLS = (
      piece_BGRLS if s_BGRLS is None else jnp.where(where_BLS[:, None, None], piece_BGRLS, s_BGRLS)
    )
  return s_BGRLS, pieces_cover(pieces)
