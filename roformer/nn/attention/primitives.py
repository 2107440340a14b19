"""The pieces every attention kernel shares: masks, scaled scores, head grouping, blocks, dropout.

Dimension legend: B batch, L query length, S key length, H query heads, G key/value heads,
R = H // G query heads per key/value head, K query/key head dim, V value head dim (K = V unless
the encoding widens queries and keys, as PoPE does to 2V), X any leading axes.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

# (qpos_BL, kpos_BS) -> float32 [B, H, L, S] or None: the positional bias of one block of positions.
BiasFn = Callable[[jax.Array, jax.Array], jax.Array | None]


# (qpos_BL, kpos_BS) -> (a [B, L, H, R] or None, b [B, S, H or 1, R]) or None: the same bias
# as a product of query and key factors (`PosEnc.bias_factors`), for kernels that add no bias.
BiasFactorsFn = Callable[[jax.Array, jax.Array], tuple | None]


# (q_BLHK, k_BSGK, mask_BLS) -> float32 [B, H, L, S]: a content-dependent bias (CoPE).
ContentBiasFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


# (qpos_BL, kpos_BS) -> pieces (query rotation positions, key rotation positions, where) of a
# block of positions (`roformer.posenc.extension`), or None.
PiecesFn = Callable[[jax.Array, jax.Array], tuple | None]


# (q_BLHK, k_BSGK, qpos_BL, kpos_BS) -> (q, k) rotated at those positions (`posenc.rotate`).
RotateFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


# Masked logits get a large finite value, not -inf, so that a block whose keys are all masked gives
# exp(NEG - NEG) = 1 instead of NaN; masked probabilities are then zeroed explicitly.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_ranks(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS):
  # Values may be narrower or wider than queries and keys (PoPE's keys are 2V wide).
  if (
    q_BLHK.ndim != 4 or k_BSGK.ndim != 4 or v_BSGV.ndim != 4
    or v_BSGV.shape[:3] != k_BSGK.shape[:3] or q_BLHK.shape[-1] != k_BSGK.shape[-1]
  ):  # fmt: skip
    raise ValueError(
      f"attention expects q [B, L, H, K], k [B, S, G, K] and v [B, S, G, V]; got "
      f"{q_BLHK.shape}, {k_BSGK.shape}, {v_BSGV.shape}"
    )
  if q_BLHK.shape[2] % k_BSGK.shape[2]:
    raise ValueError(f"{q_BLHK.shape[2]} query heads are not a multiple of {k_BSGK.shape[2]}")
  if qpos_BL.shape != q_BLHK.shape[:2] or kpos_BS.shape != k_BSGK.shape[:2]:
    raise ValueError(f"positions {qpos_BL.shape}, {kpos_BS.shape} do not match q and k")


WINDOW_KINDS = ("sliding", "blockwise", "chunked")


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
      more; inputs of at most `window` positions see every earlier key. "chunked": Llama 4's
      chunked local attention (`attention_chunk_size`): positions fall in chunks of `window`
      and a query sees keys of its own chunk only (kpos // w == qpos // w), so between 1 and
      `window` keys, all within `window` - 1 positions (inside a sliding window's band and ring
      buffer).
    global_tokens: with a window, positions below this attend to and are attended by every
      key and query of their segment (Longformer's global attention).

  Returns:
    bool [B, L, S].
  """
  mask_BLS = jnp.ones(qpos_BL.shape + kpos_BS.shape[1:], dtype=bool)
  if qseg_BL is not None:
    mask_BLS &= qseg_BL[:, :, None] == kseg_BS[:, None, :]
  rule_BLS = allowed_pairs(
    qpos_BL[:, :, None], kpos_BS[:, None, :], causal=causal, window=window,
    window_kind=window_kind, global_tokens=global_tokens,
  )  # fmt: skip
  return mask_BLS if rule_BLS is None else mask_BLS & rule_BLS


def allowed_pairs(qpos, kpos, *, causal, window=0, window_kind="sliding", global_tokens=0):
  """`attention_mask`'s rule without segments, on broadcastable query and key positions, or None
  when it allows every pair. Operators only, so it also runs on numpy arrays (the fused kernels
  plan their blocks with it, `kernels/splash.py`)."""
  allowed = (kpos <= qpos) if causal else None
  both = lambda a, b: b if a is None else a & b  # noqa: E731
  if window > 0 and window_kind == "blockwise":
    half = max(1, window // 2)
    allowed = both(allowed, kpos // half >= qpos // half - 1)
  elif window > 0 and window_kind == "chunked":
    allowed = both(allowed, kpos // window == qpos // window)
  elif window > 0:
    near = (qpos - kpos < window) & (kpos - qpos < window)
    if global_tokens > 0:
      near = near | (qpos < global_tokens) | (kpos < global_tokens)
    allowed = both(allowed, near)
  return allowed


def scores(q_BLGRK, k_BSGK, bias_BHLS):
  """Scaled logits in float32 [B, G, R, L, S] (bf16 inputs, fp32 accumulation)."""
  B, L, G, R, K = q_BLGRK.shape
  s_BGRLS = jnp.einsum("blgrk,bsgk->bgrls", q_BLGRK, k_BSGK, preferred_element_type=jnp.float32)
  s_BGRLS = s_BGRLS * (1.0 / math.sqrt(K))
  if bias_BHLS is not None:
    s_BGRLS = s_BGRLS + bias_BHLS.astype(jnp.float32).reshape(bias_BHLS.shape[0], G, R, L, -1)
  return s_BGRLS


def add_key_bias(bias_BHLS, key_bias_BSH, length: int):
  """The positional bias (or None) plus a bias per key [B, S, H] (the forget gate's -c_j),
  broadcast over `length` queries: float32 [B, H, L, S], or `bias_BHLS` when there is none."""
  if key_bias_BSH is None:
    return bias_BHLS
  B, S, H = key_bias_BSH.shape
  kb_BH1S = key_bias_BSH.astype(jnp.float32).transpose(0, 2, 1)[:, :, None, :]
  kb_BHLS = jnp.broadcast_to(kb_BH1S, (B, H, length, S))
  return kb_BHLS if bias_BHLS is None else bias_BHLS + kb_BHLS


def dropout(x, rate, key):
  """Inverted dropout; identity when `key` is None or `rate` is 0."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def split_heads(q_BLHK, num_kv_heads):
  # Query head h = g * R + r uses key/value head g (the usual GQA grouping).
  B, L, H, K = q_BLHK.shape
  return q_BLHK.reshape(B, L, num_kv_heads, H // num_kv_heads, K)


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


@jax.custom_jvp
def row_max(s_XS):
  """The max of logits [..., S] over the keys (the last axis), differentiated as `jnp.max` (the
  tangent shared evenly by the logits equal to the max) but finite when no logit equals it.

  That happens when XLA recomputes the logits in more than one fused kernel and the copies round
  differently: XLA:CPU at --xla_backend_optimization_level=0 fuses q.k / sqrt(K) + bias into one
  FMA in some kernels and not in others, so the max taken in one kernel can match no logit
  recomputed in another, and `jnp.max`'s derivative divides by zero ties (inf, then NaN in every
  gradient). A softmax does not depend on the max it subtracts, so dropping that row's tangent
  changes the gradients by rounding only."""
  return s_XS.max(axis=-1)


@row_max.defjvp
def _row_max_jvp(primals, tangents):
  (s_XS,), (t_XS,) = primals, tangents
  m_X = s_XS.max(axis=-1)
  hit_XS = (s_XS == m_X[..., None]).astype(t_XS.dtype)
  ties_X = jnp.maximum(hit_XS.sum(axis=-1), 1.0)  # >= 1 whenever the copies agree
  return m_X, (t_XS * hit_XS).sum(axis=-1) / ties_X


# ---- The blockwise kernel's body, shared by the chunked and banded kernels ----
# Carry of the online softmax over key blocks, per query block: (m_BGRq running max of the
# logits, l_BGRq running sum of exp(logit - m), acc_BGRqV running sum of exp(logit - m) v).


def online_softmax_init(B: int, G: int, R: int, bq: int, V: int, sink_GR=None) -> tuple:
  """The carry before any key block (accumulator V = the value width): nothing seen (max NEG,
  sums 0), or with sink logits [G, R] (`sinks.py`) the sink seen as a key with no value (max the
  sink, sum exp(0) = 1)."""
  if sink_GR is None:
    m_BGRq = jnp.full((B, G, R, bq), NEG, jnp.float32)
    l_BGRq = jnp.zeros((B, G, R, bq), jnp.float32)
  else:
    m_BGRq = jnp.broadcast_to(sink_GR.astype(jnp.float32)[None, :, :, None], (B, G, R, bq))
    l_BGRq = jnp.ones((B, G, R, bq), jnp.float32)
  return m_BGRq, l_BGRq, jnp.zeros((B, G, R, bq, V), jnp.float32)


def online_softmax_update(
  carry, q_BqGRK, k_BkGK, v_BkGK, mask_B11qk, bias, *, dropout_rate=0.0, dropout_key=None
) -> tuple:
  """The carry after one key block: masked logits, a rescaled running max and sums.

  Masked logits are NEG (finite), so a block whose keys are all masked leaves m unchanged and
  adds exactly zero. Dropout drops probabilities after the denominator has them, which equals
  dropping the normalised attention weights.
  """
  return online_softmax_step(
    carry, scores(q_BqGRK, k_BkGK, bias), v_BkGK, mask_B11qk, dropout_rate=dropout_rate,
    dropout_key=dropout_key,
  )  # fmt: skip


def online_softmax_step(
  carry, s_BGRqk, v_BkGK, mask_B11qk, *, dropout_rate=0.0, dropout_key=None
) -> tuple:
  """`online_softmax_update` from the block's scaled logits [B, G, R, q, k] (float32), for
  kernels that compute them otherwise (piecewise positions)."""
  m_BGRq, l_BGRq, acc_BGRqV = carry
  s_BGRqk = jnp.where(mask_B11qk, s_BGRqk, NEG)
  m_new_BGRq = jnp.maximum(m_BGRq, row_max(s_BGRqk))
  p_BGRqk = jnp.where(mask_B11qk, jnp.exp(s_BGRqk - m_new_BGRq[..., None]), 0.0)
  correction_BGRq = jnp.exp(m_BGRq - m_new_BGRq)
  l_new_BGRq = l_BGRq * correction_BGRq + p_BGRqk.sum(axis=-1)
  if dropout_key is not None:
    p_BGRqk = dropout(p_BGRqk, dropout_rate, dropout_key)
  pv_BGRqV = jnp.einsum(
    "bgrqk,bkgd->bgrqd", p_BGRqk.astype(v_BkGK.dtype), v_BkGK, preferred_element_type=jnp.float32
  )
  return m_new_BGRq, l_new_BGRq, acc_BGRqV * correction_BGRq[..., None] + pv_BGRqV


def online_softmax_output(carry, dtype) -> jax.Array:
  """[B, bq, H, V] in `dtype` from the final carry; rows with no visible key give zeros."""
  _, l_BGRq, acc_BGRqV = carry
  B, G, R, bq, V = acc_BGRqV.shape
  o_BGRqV = acc_BGRqV / jnp.where(l_BGRq == 0.0, 1.0, l_BGRq)[..., None]
  return jnp.transpose(o_BGRqV, (0, 3, 1, 2, 4)).reshape(B, bq, G * R, V).astype(dtype)


def for_each_query_block(
  query_block, q_BLHK, qpos_BL, qseg_BL, block: int, value_dim: int | None = None
) -> jax.Array:
  """Attention outputs [B, L, H, V], query block by query block: `query_block(qi, start, q_BqHK,
  qpos_Bq, qseg_Bq) -> o_BqHV` for blocks of `block` rows starting at `start`; the last block is
  shifted back to end at L, and its rows that an earlier block already wrote keep their output.

  With V = K (`value_dim` None or K) the outputs are written over the queries in place, so XLA
  needs no second [B, L, H, K] buffer; values of another width (PoPE's queries are 2V wide) get
  an output buffer of their own."""
  B, L, H, K = q_BLHK.shape
  V = K if value_dim is None else value_dim
  in_place = V == K
  bq = min(block, L)

  def write_query_block(qi, o_BLHV):
    # In place, rows before qi * bq hold outputs already and rows from there on still hold
    # rotated queries; otherwise the queries stay in q.
    start = jnp.minimum(qi * bq, L - bq)
    q_BqHK, qpos_Bq, qseg_Bq = (
      jax.lax.dynamic_slice_in_dim(x, start, bq, axis=1)
      for x in (o_BLHV if in_place else q_BLHK, qpos_BL, qseg_BL)
    )
    o_BqHV = query_block(qi, start, q_BqHK, qpos_Bq, qseg_Bq)
    if L % bq:
      done_1q11 = (start + jnp.arange(bq) < qi * bq)[None, :, None, None]
      written_BqHV = q_BqHK if in_place else jax.lax.dynamic_slice_in_dim(o_BLHV, start, bq, 1)
      o_BqHV = jnp.where(done_1q11, written_BqHV, o_BqHV)
    return jax.lax.dynamic_update_slice_in_dim(o_BLHV, o_BqHV, start, axis=1)

  init_BLHV = q_BLHK if in_place else jnp.zeros((B, L, H, V), q_BLHK.dtype)
  return jax.lax.fori_loop(0, -(-L // bq), write_query_block, init_BLHV)
