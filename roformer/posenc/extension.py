"""Training-free context extensions as piecewise positions: each kind maps a block of (query,
key) position pairs to a few pieces, each a (query rotation positions, key rotation positions,
where) triple.

A rotary score depends on the pair only through qrot[i] - krot[j], so a piece gives every pair it
covers the relative distance qrot[i] - krot[j]; pairs no piece covers are masked. The pieces of
one kind are disjoint. The attention kernels (roformer/nn/attention/piecewise.py) score each key
block once per piece with differently rotated queries and keys and merge the logits by `where`
before the online softmax, so memory stays linear in the context.

Every function takes int positions qpos_BL, kpos_BS (per window, from 0) and returns a tuple of
`Piece`. Two kinds also multiply the queries (`query_factor`): ReRoPE's released patch by log-n,
ChunkLlama's current code by the square of its cos/sin factor. Legend: B batch, L queries, S keys.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from roformer.posenc.config import ContextExtension
from roformer.posenc.query_scale import logn_scale


class Piece(NamedTuple):
  """Query rotation positions qrot_BL, key rotation positions krot_BS, and where_BLS (bool):
  the pairs whose logit is q(qrot) . k(krot)."""

  qrot_BL: jax.Array
  krot_BS: jax.Array
  where_BLS: jax.Array


def _distance(qpos_BL, kpos_BS):
  return qpos_BL[:, :, None] - kpos_BS[:, None, :]


def self_extend(ext: ContextExtension, qpos_BL, kpos_BS) -> tuple[Piece, ...]:
  """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", arXiv 2401.01325).

  Keys within the neighbour window W (distance < W) keep their positions; farther keys take
  grouped positions floor(j / G) and the query floor(i / G) + W - W / G, so that the grouped
  distance continues where the neighbour distances stop: kind "self_extend", as LongLM's code
  computes a prompt (`self_extend_patch/Llama.py`, group_query_position, a true division), its
  query rotation positions then float32 (RoPE's angles are float32 products anyway). The same
  file's decoding path shifts by W - floor(W / G), which keeps every position an integer: kind
  "self_extend_floor", W / G - floor(W / G) positions farther (0.45 at W = 32, G = 22) where G
  does not divide W, the same where it does.
  """
  W, G = ext.window, ext.group
  near_BLS = _distance(qpos_BL, kpos_BS) < W
  if ext.kind == "self_extend_floor":
    grouped_q_BL = qpos_BL // G + W - W // G
  else:
    grouped_q_BL = (qpos_BL // G).astype(jnp.float32) + jnp.float32(W - W / G)
  return (
    Piece(qpos_BL, kpos_BS, near_BLS),
    Piece(grouped_q_BL, kpos_BS // G, ~near_BLS),
  )


def dual_chunk(ext: ContextExtension, qpos_BL, kpos_BS) -> tuple[Piece, ...]:
  """Dual Chunk Attention (An et al. 2024, ChunkLlama, arXiv 2402.17463).

  Positions are cut into chunks of s; every key sits at j mod s. Intra-chunk (same chunk): the
  query at i mod s. Successive chunk (the key's chunk just before the query's): the query at
  min(i mod s + s, s + w), so the first queries of a chunk keep exact distances to the
  previous chunk's tail, up to the local window w. Inter-chunk (earlier chunks): the query at
  min(2s - 1, s + w), the largest successive-chunk position (ChunkLlama's q_states_inter).
  Keys of later chunks are left to the causal mask. ChunkLlama's chunk_size is s + w (its
  chunk_len is s).

  Kind "dca" also multiplies the logits of a sequence of n > L tokens by (0.05 ln(n / L) + 1)^2
  (`query_factor`), as ChunkLlama's code does since 2024-04-24 (its cos and sin tables times
  get_mscale(n / L); 0.1 ln from 2024-03-19; the code says the paper's results did not use it);
  kind "dca_paper" does not.
  """
  s, w = ext.chunk, ext.local
  cq_BL1 = (qpos_BL // s)[:, :, None]
  ck_B1S = (kpos_BS // s)[:, None, :]
  qin_BL = qpos_BL % s
  krot_BS = kpos_BS % s
  return (
    Piece(qin_BL, krot_BS, cq_BL1 == ck_B1S),
    Piece(jnp.minimum(qin_BL + s, s + w), krot_BS, ck_B1S == cq_BL1 - 1),
    Piece(jnp.full_like(qpos_BL, min(2 * s - 1, s + w)), krot_BS, ck_B1S < cq_BL1 - 1),
  )


def rerope(ext: ContextExtension, qpos_BL, kpos_BS) -> tuple[Piece, ...]:
  """ReRoPE (Su 2023, "Rectified Rotary Position Embeddings"): distance min(i - j, w).

  Keys beyond the window all sit at distance w: the query at w, the key at 0. Kind "rerope" also
  multiplies each query by max(1, ln(i + 1) / ln L) (`query_factor`), as the released
  `rerope_patch.py` does (training_length L); kind "rerope_clamp" is the clamp alone.
  """
  w = ext.window
  near_BLS = _distance(qpos_BL, kpos_BS) < w
  return (
    Piece(qpos_BL, kpos_BS, near_BLS),
    Piece(jnp.full_like(qpos_BL, w), jnp.zeros_like(kpos_BS), ~near_BLS),
  )


def shifted(ext: ContextExtension, qpos_BL, kpos_BS) -> tuple[Piece, ...]:
  """STRING (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?",
  arXiv 2410.18745): distances d >= S (the shifted offset) become d - S + W (W the local
  value), so the well-trained small distances overwrite the rarely trained large ones while
  the W nearest distances stay distinct; distances below S are unchanged. The query moves to
  i - S + W.

  This is the paper's formula. The authors' Llama code differs in two details it does not
  state: its two flash-attention calls both take the distance d = S (one at S, one at W, merged
  by log-sum-exp), and it multiplies RoPE's cos and sin by 0.1 ln 2 + 1 (YaRN's attention factor
  at scale 2), so its logits are (0.1 ln 2 + 1)^2 times larger. Neither is done here.
  """
  S, W = ext.shift, ext.local
  near_BLS = _distance(qpos_BL, kpos_BS) < S
  return (
    Piece(qpos_BL, kpos_BS, near_BLS),
    Piece(qpos_BL - S + W, kpos_BS, ~near_BLS),
  )


def attention_sinks(ext: ContextExtension, qpos_BL, kpos_BS) -> tuple[Piece, ...]:
  """StreamingLLM (Xiao et al. 2023, arXiv 2309.17453): the first n keys (attention sinks) and
  the w most recent keys, the query included; the rest are masked.

  Positions are those inside the rolling cache of n + w slots, as the paper assigns them: a
  recent key keeps its distance i - j, and a sink j sits at cache slot j while the query, once
  the cache is full (i >= n + w - 1), sits at the last slot n + w - 1, so its distance is
  min(i, n + w - 1) - j.
  """
  n, w = ext.sinks, ext.window
  d_BLS = _distance(qpos_BL, kpos_BS)
  recent_BLS = d_BLS < w
  sink_BLS = ~recent_BLS & (kpos_BS < n)[:, None, :]
  return (
    Piece(qpos_BL, kpos_BS, recent_BLS),
    Piece(jnp.minimum(qpos_BL, n + w - 1), kpos_BS, sink_BLS),
  )


EXTENSIONS: dict[str, Callable[..., tuple[Piece, ...]]] = {
  "self_extend": self_extend,
  "self_extend_floor": self_extend,
  "dca": dual_chunk,
  "dca_paper": dual_chunk,
  "rerope": rerope,
  "rerope_clamp": rerope,
  "string": shifted,
  "sinks": attention_sinks,
}


def position_pieces(ext: ContextExtension, qpos_BL, kpos_BS) -> tuple[Piece, ...]:
  """The pieces of `ext` for a block of positions (int [B, L] and [B, S])."""
  return EXTENSIONS[ext.kind](ext, qpos_BL, kpos_BS)


# ChunkLlama's get_mscale: its cos and sin tables are multiplied by 0.05 ln(n / L) + 1.
DCA_MSCALE = 0.05


def query_factor(ext: ContextExtension, qpos_BL: jax.Array) -> jax.Array | None:
  """float32 [B, L] factor of each query under `ext`, or None for kinds that change positions
  only. Needs `ext.train_len` (the evaluation sets it to the run's training length).

  - rerope: max(1, ln(i + 1) / ln L) at position i (bojone's `rerope_patch.py`).
  - dca: (0.05 ln(n / L) + 1)^2 for a sequence of n > L tokens, else 1: ChunkLlama scales both
    the queries' and the keys' cos and sin by 0.05 ln(n / L) + 1, so every logit takes its square.
    n is the row's last position + 1: a prompt's length (ChunkLlama's kv_seq_len), at a decoding
    step the length so far (ChunkLlama's cached keys keep the factor of the step that rotated
    them).
  """
  if ext.kind not in ("rerope", "dca"):
    return None
  if ext.train_len < 2:
    raise ValueError(
      f"posenc.extension.kind={ext.kind!r} needs posenc.extension.train_len >= 2 (the training "
      "length of its query factor; eval.py sets the run's)"
    )
  if ext.kind == "rerope":  # the patch's clip(1) of log(i + 1) / log L is Qwen's log-n
    return logn_scale(qpos_BL, ext.train_len)
  log_L = jnp.log(jnp.float32(ext.train_len))
  n_B1 = jnp.max(qpos_BL, axis=1, keepdims=True).astype(jnp.float32) + 1.0
  mscale_B1 = 1.0 + DCA_MSCALE * jnp.maximum(0.0, jnp.log(n_B1) - log_L)
  return jnp.broadcast_to(mscale_B1**2, qpos_BL.shape)
