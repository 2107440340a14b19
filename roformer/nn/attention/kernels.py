"""Attention layer (MHA/GQA/MQA over explicit positions) and its interchangeable kernels.

Dimension legend: B batch, L query length, S key length, H query heads, G key/value heads,
R = H // G query heads per key/value head, K head dim, D model dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
  from roformer.posenc import PosEnc

# (qpos_BL, kpos_BS) -> float32 [B, H, L, S] or None: the positional bias of one block of positions.
BiasFn = Callable[[jax.Array, jax.Array], jax.Array | None]
# (q_BLHK, k_BSGK, mask_BLS) -> float32 [B, H, L, S]: a content-dependent bias (CoPE).
ContentBiasFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# Masked logits get a large finite value, not -inf, so that a block whose keys are all masked gives
# exp(NEG - NEG) = 1 instead of NaN; masked probabilities are then zeroed explicitly.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


# ---- Shared pieces of every kernel ----


def _check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS):
  if q_BLHK.ndim != 4 or k_BSGK.ndim != 4 or v_BSGK.shape != k_BSGK.shape:
    raise ValueError(
      f"attention expects q [B, L, H, K] and k, v [B, S, G, K]; got {q_BLHK.shape}, "
      f"{k_BSGK.shape}, {v_BSGK.shape}"
    )
  if q_BLHK.shape[2] % k_BSGK.shape[2]:
    raise ValueError(f"{q_BLHK.shape[2]} query heads are not a multiple of {k_BSGK.shape[2]}")
  if qpos_BL.shape != q_BLHK.shape[:2] or kpos_BS.shape != k_BSGK.shape[:2]:
    raise ValueError(f"positions {qpos_BL.shape}, {kpos_BS.shape} do not match q and k")


WINDOW_KINDS = ("sliding", "blockwise")


def attention_mask(
  qpos_BL,
  kpos_BS,
  qseg_BL=None,
  kseg_BS=None,
  *,
  causal,
  window=0,
  window_kind="sliding",
  global_tokens=0,
):
  """Which keys each query may attend to.

  Args:
    qpos_BL, kpos_BS: int positions of queries and keys.
    qseg_BL, kseg_BS: int segment ids (None: one segment); keys must share the query's id.
    causal: keys must not come after the query (kpos <= qpos).
    window: if > 0, limits the keys by `window_kind`.
    window_kind: "sliding": keys within `window` positions of the query (|qpos - kpos| < window,
      which for causal attention is qpos - kpos < window). "blockwise": xPos's blockwise causal
      attention (BCA, the LeX code): positions fall in blocks of window / 2, and a query sees
      keys of its own block and of the block before (kpos // b >= qpos // b - 1 with
      b = window // 2), so between window / 2 and `window` keys and no distance of `window` or
      more; inputs of at most `window` positions see every earlier key.
    global_tokens: with a window, positions below this attend to and are attended by every
      key and query of their segment (Longformer's global attention).

  Returns:
    bool [B, L, S].
  """
  qpos_BL1 = qpos_BL[:, :, None]
  kpos_B1S = kpos_BS[:, None, :]
  mask_BLS = jnp.ones(qpos_BL.shape + kpos_BS.shape[1:], dtype=bool)
  if qseg_BL is not None:
    mask_BLS &= qseg_BL[:, :, None] == kseg_BS[:, None, :]
  if causal:
    mask_BLS &= kpos_B1S <= qpos_BL1
  if window > 0 and window_kind == "blockwise":
    half = max(1, window // 2)
    mask_BLS &= kpos_B1S // half >= qpos_BL1 // half - 1
  elif window > 0:
    near_BLS = jnp.abs(qpos_BL1 - kpos_B1S) < window
    if global_tokens > 0:
      near_BLS |= (qpos_BL1 < global_tokens) | (kpos_B1S < global_tokens)
    mask_BLS &= near_BLS
  return mask_BLS


def _scores(q_BLGRK, k_BSGK, bias_BHLS):
  """Scaled logits in float32 [B, G, R, L, S] (bf16 inputs, fp32 accumulation)."""
  B, L, G, R, K = q_BLGRK.shape
  s_BGRLS = jnp.einsum("blgrk,bsgk->bgrls", q_BLGRK, k_BSGK, preferred_element_type=jnp.float32)
  s_BGRLS = s_BGRLS * (1.0 / math.sqrt(K))
  if bias_BHLS is not None:
    s_BGRLS = s_BGRLS + bias_BHLS.astype(jnp.float32).reshape(bias_BHLS.shape[0], G, R, L, -1)
  return s_BGRLS


def dropout(x, rate, key):
  """Inverted dropout; identity when `key` is None or `rate` is 0."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _split_heads(q_BLHK, num_kv_heads):
  # Query head h = g * R + r uses key/value head g (the usual GQA grouping).
  B, L, H, K = q_BLHK.shape
  return q_BLHK.reshape(B, L, num_kv_heads, H // num_kv_heads, K)


# ---- Kernels ----


def dense_attention(
  q_BLHK,
  k_BSGK,
  v_BSGK,
  qpos_BL,
  kpos_BS,
  *,
  qseg_BL=None,
  kseg_BS=None,
  causal: bool = False,
  window: int = 0,
  window_kind: str = "sliding",
  bias_fn: BiasFn | None = None,
  content_bias_fn: ContentBiasFn | None = None,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
  block: int = 512,
  global_tokens: int = 0,
):
  """Reference kernel: materialises the [L, S] scores, fp32 softmax.

  Args:
    q_BLHK: queries (already rotated), any float dtype.
    k_BSGK, v_BSGK: keys (already rotated) and values; H must be a multiple of G.
    qpos_BL, kpos_BS: int positions of queries and keys (for masks and `bias_fn`).
    qseg_BL, kseg_BS: int segment ids, or None for a single segment.
    causal, window, window_kind: see `attention_mask`.
    bias_fn: positional bias of a block of positions, e.g. `posenc.bias`.
    content_bias_fn: bias from queries, keys and the mask, e.g. `posenc.content_bias` (CoPE).
    dropout_rate, dropout_key: attention-probability dropout (no dropout when the key is None).
    block: unused (kept so every kernel has the same signature).
    global_tokens: see `attention_mask`.

  Returns:
    [B, L, H, K] in the dtype of q. A query with no allowed key gets zeros.
  """
  del block
  _check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  B, L, H, K = q_BLHK.shape
  G = k_BSGK.shape[2]
  bias_BHLS = None if bias_fn is None else bias_fn(qpos_BL, kpos_BS)
  # Bidirectional attention over one segment needs no mask at all.
  masked = qseg_BL is not None or causal or window > 0
  mask_BLS = None
  if masked:
    mask_BLS = attention_mask(
      qpos_BL, kpos_BS, qseg_BL, kseg_BS, causal=causal, window=window, window_kind=window_kind,
      global_tokens=global_tokens,
    )  # fmt: skip
  if content_bias_fn is not None:
    content_BHLS = content_bias_fn(q_BLHK, k_BSGK, mask_BLS)
    bias_BHLS = content_BHLS if bias_BHLS is None else bias_BHLS + content_BHLS
  s_BGRLS = _scores(_split_heads(q_BLHK, G), k_BSGK, bias_BHLS)
  if masked:
    s_BGRLS = jnp.where(mask_BLS[:, None, None], s_BGRLS, _NEG)
  # fp32 softmax for stability. jax.nn.softmax's custom JVP keeps the backward pass to one
  # reduction; a masked key gets exp(_NEG - max) = 0 exactly unless its whole row is masked.
  p_BGRLS = dropout(jax.nn.softmax(s_BGRLS, axis=-1), dropout_rate, dropout_key)
  o_BLGRK = jnp.einsum(
    "bgrls,bsgk->blgrk", p_BGRLS.astype(v_BSGK.dtype), v_BSGK, preferred_element_type=jnp.float32
  )
  if masked:  # a query with no allowed key gets zeros (as in `chunked`), not the mean of v
    o_BLGRK = jnp.where(mask_BLS.any(axis=-1)[:, :, None, None, None], o_BLGRK, 0.0)
  return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)


def split_blocks(x_BT, block, value=0):
  """[B, T, ...] -> [N, B, block, ...] with N = ceil(T / block), padding T with `value`.

  The leading axis is the one mapped or scanned over.
  """
  B, T = x_BT.shape[:2]
  n = -(-T // block)
  widths = [(0, 0)] * x_BT.ndim
  widths[1] = (0, n * block - T)
  x_BT = jnp.pad(x_BT, widths, constant_values=value)
  return jnp.moveaxis(x_BT.reshape(B, n, block, *x_BT.shape[2:]), 1, 0)


def chunked_attention(
  q_BLHK,
  k_BSGK,
  v_BSGK,
  qpos_BL,
  kpos_BS,
  *,
  qseg_BL=None,
  kseg_BS=None,
  causal: bool = False,
  window: int = 0,
  window_kind: str = "sliding",
  bias_fn: BiasFn | None = None,
  content_bias_fn: ContentBiasFn | None = None,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
  block: int = 512,
  global_tokens: int = 0,
):
  """Blockwise online-softmax kernel: memory O(L * block), any L and S.

  A fori_loop runs over query blocks and a scan over key blocks with a running max, denominator
  and accumulator (fp32). The positional bias and the mask are computed per block from positions,
  so no [L, S] array ever exists; key blocks with no allowed key (e.g. after the query block under
  a causal mask) are skipped. Each query block's output is written over the rotated queries it
  was computed from, which no later block reads, so XLA reuses q's buffer for the output instead
  of stacking the blocks into a new one (when L is not a multiple of the block, the last block is
  shifted back to end at L and keeps the rows already written). Both loop bodies are
  rematerialised, so gradients store only the inputs of each query block rather than every
  block's scores. Attention dropout drops the unnormalised block probabilities with a key folded
  from (query block, key block); the denominator is not dropped, which equals dropping the
  normalised probabilities.

  Windowed self-attention without global tokens visits only the key blocks inside the window
  (`roformer.attention_window`): O(L * w) time instead of a scan over every key block.

  Args and returns: as `dense_attention`; `block` is the query and key block size. A
  `content_bias_fn` is refused: its cumulative sums run across key blocks.
  """
  if content_bias_fn is not None:
    raise ValueError(
      "the chunked attention kernel cannot add a content-dependent positional bias (posenc.kind="
      "'cope'); set model.attention_impl to 'dense' or 'auto'"
    )
  _check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  B, L, H, K = q_BLHK.shape
  S, G = k_BSGK.shape[1:3]
  if window > 0 and not global_tokens and S == L:
    from roformer.nn.attention import (
      banded as attention_window,  # it builds on this module's pieces
    )

    if attention_window.visited_blocks(L, block, window, causal) < -(-L // min(block, L)):
      return attention_window.banded_attention(
        q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, qseg_BL=qseg_BL, kseg_BS=kseg_BS,
        causal=causal, window=window, window_kind=window_kind, bias_fn=bias_fn,
        dropout_rate=dropout_rate, dropout_key=dropout_key, block=block,
      )  # fmt: skip
  R = H // G
  bq, bk = min(block, L), min(block, S)
  nq, nk = -(-L // bq), -(-S // bk)
  if qseg_BL is None:
    qseg_BL = jnp.zeros((B, L), jnp.int32)
    kseg_BS = jnp.zeros((B, S), jnp.int32)
  # Padded keys are excluded by `kvalid`.
  kvalid_BS = jnp.ones((B, S), bool)
  k_xs = (jnp.arange(nk),) + tuple(
    split_blocks(x, bk) for x in (k_BSGK, v_BSGK, kpos_BS, kseg_BS, kvalid_BS)
  )

  @jax.checkpoint
  def query_block(qi, q_BqHK, qpos_Bq, qseg_Bq):
    q_BqGRK = _split_heads(q_BqHK, G)

    def key_block(carry, k_args):
      ki, k_BkGK, v_BkGK, kpos_Bk, kseg_Bk, kvalid_Bk = k_args
      mask_BqBk = attention_mask(
        qpos_Bq, kpos_Bk, qseg_Bq, kseg_Bk, causal=causal, window=window,
        window_kind=window_kind, global_tokens=global_tokens,
      )  # fmt: skip
      mask_B11qk = (mask_BqBk & kvalid_Bk[:, None, :])[:, None, None]

      def update(carry):
        m_BGRq, l_BGRq, acc_BGRqK = carry
        bias = None if bias_fn is None else bias_fn(qpos_Bq, kpos_Bk)
        s_BGRqk = jnp.where(mask_B11qk, _scores(q_BqGRK, k_BkGK, bias), _NEG)
        m_new_BGRq = jnp.maximum(m_BGRq, s_BGRqk.max(axis=-1))
        p_BGRqk = jnp.where(mask_B11qk, jnp.exp(s_BGRqk - m_new_BGRq[..., None]), 0.0)
        correction_BGRq = jnp.exp(m_BGRq - m_new_BGRq)
        l_new_BGRq = l_BGRq * correction_BGRq + p_BGRqk.sum(axis=-1)
        if dropout_key is not None:
          key = jax.random.fold_in(jax.random.fold_in(dropout_key, qi), ki)
          p_BGRqk = dropout(p_BGRqk, dropout_rate, key)
        pv_BGRqK = jnp.einsum(
          "bgrqk,bkgd->bgrqd",
          p_BGRqk.astype(v_BkGK.dtype),
          v_BkGK,
          preferred_element_type=jnp.float32,
        )
        return m_new_BGRq, l_new_BGRq, acc_BGRqK * correction_BGRq[..., None] + pv_BGRqK

      return jax.lax.cond(mask_B11qk.any(), update, lambda c: c, carry), None

    init = (
      jnp.full((B, G, R, bq), _NEG, jnp.float32),
      jnp.zeros((B, G, R, bq), jnp.float32),
      jnp.zeros((B, G, R, bq, K), jnp.float32),
    )
    (_, l_BGRq, acc_BGRqK), _ = jax.lax.scan(jax.checkpoint(key_block), init, k_xs)
    o_BGRqK = acc_BGRqK / jnp.where(l_BGRq == 0.0, 1.0, l_BGRq)[..., None]
    o_BqGRK = jnp.transpose(o_BGRqK, (0, 3, 1, 2, 4))
    return o_BqGRK.reshape(B, bq, H, K).astype(q_BLHK.dtype)

  def write_query_block(qi, qo_BLHK):
    # Rows before qi * bq hold outputs already; rows from there on still hold rotated queries.
    start = jnp.minimum(qi * bq, L - bq)
    q_BqHK, qpos_Bq, qseg_Bq = (
      jax.lax.dynamic_slice_in_dim(x, start, bq, axis=1) for x in (qo_BLHK, qpos_BL, qseg_BL)
    )
    o_BqHK = query_block(qi, q_BqHK, qpos_Bq, qseg_Bq)
    if L % bq:
      done_1q11 = (start + jnp.arange(bq) < qi * bq)[None, :, None, None]
      o_BqHK = jnp.where(done_1q11, q_BqHK, o_BqHK)
    return jax.lax.dynamic_update_slice_in_dim(qo_BLHK, o_BqHK, start, axis=1)

  return jax.lax.fori_loop(0, nq, write_query_block, q_BLHK)


def auto_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, *, block: int = 512, **kwargs):
  """`dense` when L * S <= block**2 (small enough to materialise) or with a content bias (which
  only `dense` computes), else `chunked`."""
  small = q_BLHK.shape[1] * k_BSGK.shape[1] <= block * block
  if small or kwargs.get("content_bias_fn") is not None:
    return dense_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, block=block, **kwargs)
  return chunked_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, block=block, **kwargs)


KERNELS = {"dense": dense_attention, "chunked": chunked_attention, "auto": auto_attention}


# ---- The layer ----


def _kernel_init(in_axis, out_axis, names):
  # fan-in scaling over the contracted axes (the default would take the wrong fan for 3-D kernels).
  init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
  )
  return nnx.with_partitioning(init, names)


class Attention(nnx.Module):
  """Self-attention with q/k/v/out projections; positions enter only through `posenc`.

  Parameters (logical axes): query.kernel [D, H, K] ('embed', 'heads', 'kv'), key.kernel and
  value.kernel [D, G, K], out.kernel [H, K, D] ('heads', 'kv', 'embed'); with `use_bias`,
  query.bias [H, K] and key/value.bias [G, K] ('heads', 'kv') and out.bias [D] ('embed',).
  """

  def __init__(
    self,
    emb_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    num_kv_heads: int = 0,
    causal: bool,
    use_bias: bool = True,
    dropout_rate: float = 0.0,
    impl: str = "auto",
    block: int = 512,
    window: int = 0,
    window_kind: str = "sliding",
    global_tokens: int = 0,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    num_kv_heads = num_kv_heads or num_heads
    if impl not in KERNELS:
      raise ValueError(f"model.attention_impl={impl!r} is not one of {sorted(KERNELS)}")
    if num_heads % num_kv_heads:
      raise ValueError(
        f"model.num_heads={num_heads} is not divisible by model.num_kv_heads={num_kv_heads}"
      )
    D, H, G, K = emb_dim, num_heads, num_kv_heads, head_dim
    self.causal = causal
    self.dropout_rate = dropout_rate
    self.impl = impl
    self.block = block
    self.window = window
    self.window_kind = window_kind
    self.global_tokens = global_tokens
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    hk_bias = nnx.with_partitioning(nnx.initializers.zeros, ("heads", "kv"))
    qkv_init = _kernel_init(0, (1, 2), ("embed", "heads", "kv"))
    self.query = nnx.Einsum(
      "BLD,DHK->BLHK", (D, H, K), (H, K) if use_bias else None,
      kernel_init=qkv_init, bias_init=hk_bias, **common,
    )  # fmt: skip
    self.key = nnx.Einsum(
      "BSD,DGK->BSGK", (D, G, K), (G, K) if use_bias else None,
      kernel_init=qkv_init, bias_init=hk_bias, **common,
    )  # fmt: skip
    self.value = nnx.Einsum(
      "BSD,DGK->BSGK", (D, G, K), (G, K) if use_bias else None,
      kernel_init=qkv_init, bias_init=hk_bias, **common,
    )  # fmt: skip
    self.out = nnx.Einsum(
      "BLHK,HKD->BLD", (H, K, D), (D,) if use_bias else None,
      kernel_init=_kernel_init((0, 1), 2, ("heads", "kv", "embed")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **common,
    )  # fmt: skip

  def qkv(self, x_BLD):
    """Projections (position-wise): x [B, L, D] -> q [B, L, H, K], k and v [B, L, G, K]."""
    return self.query(x_BLD), self.key(x_BLD), self.value(x_BLD)

  def attend(
    self,
    q_BLHK,
    k_BLGK,
    v_BLGK,
    pos_BL,
    posenc: PosEnc,
    *,
    segment_ids_BL=None,
    dropout_key: jax.Array | None = None,
    rotary_state=None,
  ):
    """Rotates q and k with `posenc`, then runs the kernel with `posenc.bias`.

    Args:
      q_BLHK, k_BLGK, v_BLGK: projections from `qkv`.
      pos_BL: int positions.
      posenc: the model's positional encoding (its `rotate` and `bias` hooks are used).
      segment_ids_BL: int segment ids; None means one segment.
      dropout_key: key for attention-probability dropout; None disables it.
      rotary_state: `posenc.prepare` of the forward pass; None prepares it from `pos_BL`.

    Returns:
      [B, L, H, K] in the dtype of q.
    """
    q_BLHK, k_BLGK = posenc.rotate(q_BLHK, k_BLGK, pos_BL, pos_BL, rotary_state)
    return KERNELS[self.impl](
      q_BLHK,
      k_BLGK,
      v_BLGK,
      pos_BL,
      pos_BL,
      qseg_BL=segment_ids_BL,
      kseg_BS=segment_ids_BL,
      causal=self.causal,
      window=self.window,
      window_kind=self.window_kind,
      bias_fn=posenc.bias,
      content_bias_fn=posenc.content_bias,
      dropout_rate=self.dropout_rate,
      dropout_key=dropout_key,
      block=self.block,
      global_tokens=self.global_tokens,
    )

  def __call__(
    self,
    x_BLD,
    pos_BL,
    posenc: PosEnc,
    *,
    segment_ids_BL=None,
    dropout_key: jax.Array | None = None,
  ):
    """Self-attention over x [B, L, D] at positions pos [B, L] -> [B, L, D]."""
    o_BLHK = self.attend(
      *self.qkv(x_BLD), pos_BL, posenc, segment_ids_BL=segment_ids_BL, dropout_key=dropout_key
    )
    return self.out(o_BLHK)
