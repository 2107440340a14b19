"""Linear attention with RoPE (RoFormer, Su et al. 2021, section 3.3, eq. 19).

  o_m = sum_n (R_m phi(q_m))^T (R_n phi(k_n)) v_n / sum_n phi(q_m)^T phi(k_n)

phi is a positive feature map: elu(x) + 1 (the paper's) or Performer's positive random features
(FAVOR+, the paper's PerFormer + RoPE). The encoding's `rotate` hook turns phi(q) and phi(k)
into R phi(q) and R phi(k) in the numerator only; the denominator stays unrotated, so it is
positive. Attention is bidirectional (encoders) or causal (decoders) and respects segment ids
(packed documents, which must be contiguous). Both are computed blockwise: a scan over chunks of
`model.attention_block` tokens carries the running sums S = sum_n R phi(k_n) v_n^T [K, V] and
z = sum_n phi(k_n) [K], so memory is O(L * K^2 / chunk) and never O(L^2). Bidirectional
attention is the inclusive prefix plus the exclusive suffix (a causal pass over the reversed
sequence). Decoding keeps (S, z) as a recurrent state: a cache of constant size.

A bias encoding (ALiBi, T5) acts on the logits, which linear attention never forms: that is a
config error. Sliding windows, global tokens and attention dropout do not apply either.

Legend: B batch, L length, c chunk, G key/value heads, R = H // G, K head dim (V = K).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from roformer.nn.attention.kernels import KERNELS
from roformer.nn.attention.primitives import split_blocks
from roformer.nn.attention.softmax import Attention

FEATURE_MAPS = ("elu", "favor")
_FAVOR_SEED = 0  # the random features are a fixed function of the seed, not parameters


def feature_map(x_BLHK: jax.Array, kind: str, *, is_query: bool) -> jax.Array:
  """Positive features phi(x), float32, as wide as x (K features, so RoPE can rotate them).

  elu: elu(x) + 1. favor: exp(w^T x' - |x'|^2 / 2) / sqrt(K) with x' = x / K^(1/4) and fixed
  Gaussian w [K, K]; for queries a per-row constant is subtracted inside the exp for stability
  (it cancels between numerator and denominator); keys get none, so decoding stays exact.
  """
  x_BLHK = x_BLHK.astype(jnp.float32)
  if kind == "elu":
    return jax.nn.elu(x_BLHK) + 1.0
  K = x_BLHK.shape[-1]
  w_KM = jax.random.normal(jax.random.PRNGKey(_FAVOR_SEED), (K, K), jnp.float32)
  x_BLHK = x_BLHK * K**-0.25
  logits_BLHM = jnp.einsum("blhk,km->blhm", x_BLHK, w_KM)
  logits_BLHM = logits_BLHM - 0.5 * jnp.sum(x_BLHK * x_BLHK, axis=-1, keepdims=True)
  if is_query:
    logits_BLHM = logits_BLHM - jax.lax.stop_gradient(logits_BLHM.max(axis=-1, keepdims=True))
  return jnp.exp(logits_BLHM) / math.sqrt(K)


class LinearState(NamedTuple):
  """Running sums of one layer: S = sum R phi(k) v^T [B, G, K, V], z = sum phi(k) [B, G, K]."""

  s_BGKV: jax.Array
  z_BGK: jax.Array


def causal_linear_sums(qr_BLGRK, qf_BLGRK, kr_BLGK, kf_BLGK, v_BLGV, seg_BL, *, chunk, inclusive):
  """Numerators [B, L, G, R, V] and denominators [B, L, G, R] over keys n <= m (n < m if not
  `inclusive`) of the query's segment, and the sums over the last segment (a LinearState).

  A scan over chunks carries the sums of the segment running at the chunk's end; a query uses
  them only if it is in that segment, and within a chunk a [c, c] mask adds the rest.
  """
  B, L, G, R, K = qr_BLGRK.shape
  c = min(chunk, L)
  pad = -(-L // c) * c - L
  # Padded keys have zero features (no contribution); padded segment ids repeat the last one, so
  # the final sums are those of the row's last segment.
  seg_BL = jnp.pad(seg_BL, ((0, 0), (0, pad)), mode="edge")
  xs = tuple(split_blocks(x, c) for x in (qr_BLGRK, qf_BLGRK, kr_BLGK, kf_BLGK, v_BLGV, seg_BL))
  tri_cd = jnp.tril(jnp.ones((c, c), bool), 0 if inclusive else -1)

  @jax.checkpoint
  def body(carry, blocks):
    s_BGKV, z_BGK, cseg_B = carry
    qr, qf, kr, kf, v, seg_Bc = blocks
    cont_Bc = (seg_Bc == cseg_B[:, None]).astype(jnp.float32)
    num = jnp.einsum("bcgrk,bgkv->bcgrv", qr, s_BGKV) * cont_Bc[:, :, None, None, None]
    den = jnp.einsum("bcgrk,bgk->bcgr", qf, z_BGK) * cont_Bc[:, :, None, None]
    mask_B11cd = ((seg_Bc[:, :, None] == seg_Bc[:, None, :]) & tri_cd[None])[:, None, None]
    a_BGRcd = jnp.where(mask_B11cd, jnp.einsum("bcgrk,bdgk->bgrcd", qr, kr), 0.0)
    num = num + jnp.einsum("bgrcd,bdgv->bcgrv", a_BGRcd, v)
    b_BGRcd = jnp.where(mask_B11cd, jnp.einsum("bcgrk,bdgk->bgrcd", qf, kf), 0.0)
    den = den + jnp.moveaxis(b_BGRcd.sum(-1), 3, 1)
    last_B = seg_Bc[:, -1]
    keep_B = (last_B == cseg_B).astype(jnp.float32)
    in_last_Bc1 = (seg_Bc == last_B[:, None]).astype(jnp.float32)[:, :, None, None]
    s_BGKV = s_BGKV * keep_B[:, None, None, None] + jnp.einsum(
      "bdgk,bdgv->bgkv", kr * in_last_Bc1, v
    )
    z_BGK = z_BGK * keep_B[:, None, None] + jnp.sum(kf * in_last_Bc1, axis=1)
    return (s_BGKV, z_BGK, last_B), (num, den)

  init = (
    jnp.zeros((B, G, K, v_BLGV.shape[-1]), jnp.float32),
    jnp.zeros((B, G, K), jnp.float32),
    jnp.full((B,), jnp.iinfo(jnp.int32).min, seg_BL.dtype),
  )
  (s_BGKV, z_BGK, _), (num, den) = jax.lax.scan(body, init, xs)

  def unblock(x):  # [n, B, c, ...] -> [B, L, ...]
    return jnp.moveaxis(x, 0, 1).reshape(B, -1, *x.shape[3:])[:, :L]

  return unblock(num), unblock(den), LinearState(s_BGKV, z_BGK)


class LinearAttention(Attention):
  """Linear attention with RoPE; the projections are `Attention`'s (same parameters)."""

  def __init__(self, cfg, spec, *, rngs):
    # Windows, QK-norm, query temperature, sinks and the forget gate are refused for it when
    # the config is checked, so what it takes of `Attention` is its projections.
    super().__init__(cfg, spec, rngs=rngs)
    self.feature_map = cfg.linear_feature_map

  @classmethod
  def check_config(cls, cfg, posenc_cls) -> None:
    if cfg.linear_feature_map not in FEATURE_MAPS:
      raise ValueError(
        f"model.linear_feature_map={cfg.linear_feature_map!r} is not one of {list(FEATURE_MAPS)}"
      )
    if KERNELS[cfg.attention_impl].platform is not None:  # a fused kernel, not XLA's ops
      raise ValueError(
        f"model.attention_impl={cfg.attention_impl!r} is a softmax kernel, which "
        "model.attention='linear' does not use (its blockwise prefix sums are its kernel); "
        "leave model.attention_impl='auto'"
      )
    if posenc_cls is not None and posenc_cls.acts_on_logits():
      raise ValueError(
        f"posenc.kind={cfg.posenc.kind!r} adds a bias to the attention logits, which "
        "model.attention='linear' never forms; use a rotary, absolute or no encoding "
        "(e.g. posenc.kind='rope') or model.attention='softmax'"
      )
    head_dim = cfg.head_dim or cfg.emb_dim // cfg.num_heads
    if posenc_cls is not None and posenc_cls.rotated_dim(cfg.posenc, head_dim) != head_dim:
      raise ValueError(
        f"posenc.kind={cfg.posenc.kind!r} widens queries and keys beyond the values, which "
        "model.attention='linear' does not support (its running sums and denominator take "
        "features as wide as the values); use model.attention='softmax'"
      )
    if cfg.attention_window or cfg.attention_window_pattern or cfg.global_tokens:
      raise ValueError(
        "model.attention='linear' attends to every key: set model.attention_window=0, "
        "model.attention_window_pattern='' and model.global_tokens=0"
      )

  @classmethod
  def rotary_head_dim(cls, cfg, head_dim: int) -> int:
    del cfg
    return head_dim

  def _features(self, q_BLHK, k_BLGK, pos_BL, posenc, rotary_state):
    G = k_BLGK.shape[2]
    qf_BLHK = feature_map(q_BLHK, self.feature_map, is_query=True)
    kf_BLGK = feature_map(k_BLGK, self.feature_map, is_query=False)
    qr_BLHK, kr_BLGK = posenc.rotate(qf_BLHK, kf_BLGK, pos_BL, pos_BL, rotary_state)
    B, L, H, K = q_BLHK.shape
    group = lambda x: x.reshape(B, L, G, H // G, K)  # noqa: E731
    return group(qr_BLHK), group(qf_BLHK), kr_BLGK, kf_BLGK

  def __call__(
    self, x_BLD, pos_BL, posenc, *, cache: LinearState | None = None, segment_ids_BL=None,
    dropout_key=None, rotary_state=None,
  ):  # fmt: skip
    """Eq. 19 -> (heads [B, L, H, K], state); arguments as `Attention.__call__`.

    Without a cache, the sums run over the whole sequence. With one, L > 1 is the prefill of an
    empty state (the causal sums over the prompt, whose final (S, z) is the new state) and L = 1
    one recurrent step.
    """
    del dropout_key  # no attention probabilities to drop
    q_BLHK, k_BLGK, v_BLGK = self.qkv(x_BLD)
    if cache is None or q_BLHK.shape[1] > 1:
      o_BLHK, state = self._attend(
        q_BLHK, k_BLGK, v_BLGK, pos_BL, posenc, segment_ids_BL, rotary_state
      )
      return o_BLHK, None if cache is None else state
    qr, qf, kr_B1GK, kf_B1GK = self._features(q_BLHK, k_BLGK, pos_BL, posenc, rotary_state)
    s_BGKV = cache.s_BGKV + jnp.einsum("bgk,bgv->bgkv", kr_B1GK[:, 0], v_BLGK[:, 0])
    z_BGK = cache.z_BGK + kf_B1GK[:, 0]
    num = jnp.einsum("blgrk,bgkv->blgrv", qr, s_BGKV)
    den = jnp.einsum("blgrk,bgk->blgr", qf, z_BGK)
    o_BLHK = (num / den[..., None]).reshape(q_BLHK.shape).astype(q_BLHK.dtype)
    return o_BLHK, LinearState(s_BGKV, z_BGK)

  def _attend(self, q_BLHK, k_BLGK, v_BLGK, pos_BL, posenc, seg_BL, rotary_state):
    B, L, H, K = q_BLHK.shape
    seg_BL = jnp.zeros((B, L), jnp.int32) if seg_BL is None else seg_BL
    feats = self._features(q_BLHK, k_BLGK, pos_BL, posenc, rotary_state)
    v_BLGV = v_BLGK.astype(jnp.float32)
    num, den, state = causal_linear_sums(*feats, v_BLGV, seg_BL, chunk=self.block, inclusive=True)
    if not self.causal:  # add the keys after the query: a causal pass over the reversed row
      flip = lambda x: jnp.flip(x, axis=1)  # noqa: E731
      num_after, den_after, _ = causal_linear_sums(
        *map(flip, feats), flip(v_BLGV), flip(seg_BL), chunk=self.block, inclusive=False
      )
      num, den = num + flip(num_after), den + flip(den_after)
    o_BLGRV = num / den[..., None]
    return o_BLGRV.reshape(B, L, H, -1).astype(q_BLHK.dtype), state

  def init_cache(self, batch: int, max_len: int) -> LinearState:
    """The recurrent state: constant size, whatever `max_len`."""
    del max_len
    _, G, K = self.key.kernel.shape
    return LinearState(jnp.zeros((batch, G, K, K), jnp.float32), jnp.zeros((batch, G, K)))
