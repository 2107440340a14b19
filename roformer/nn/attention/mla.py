"""Multi-head latent attention with decoupled RoPE (DeepSeek-V2, Liu et al. 2024).

Keys and values are compressed jointly into a latent c = RMSNorm(x W_dkv) of `kv_lora_rank`
dims, and expanded per head: k_nope = c W_uk, v = c W_uv. Positions enter through a separate
rotary key of `qk_rope_head_dim` dims, k_rope = rotate(x W_kr), shared by all heads, which is
concatenated to k_nope; queries get a matching rotary part (from an optional latent of
`q_lora_rank` dims). The encoding rotates only those rotary parts, through its `rotate` hook
(built with head_dim = qk_rope_head_dim), so every RoPE scaling applies; under YaRN with
`mscale_all_dim` the softmax scale is multiplied by mscale^2 as DeepSeek does
(`mla_softmax_factor`). A decoding cache holds only c and the rotated k_rope: kv_lora_rank +
qk_rope_head_dim numbers per token and layer, whatever the number of heads. Cached keys and
values are re-expanded from the latent at each step (the weight-absorbed form, which attends in
the latent space directly, is not implemented).

Legend: B batch, L queries, S keys, C cache slots, D model dim, H heads, N = head_dim (the
non-rotary query/key part and the value width), R = qk_rope_head_dim, Q = q_lora_rank,
P = kv_lora_rank.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from roformer.nn.attention import kv_cache
from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.kernels import KERNELS, dense_attention
from roformer.nn.attention.softmax import attention_dropout, check_kernel_config, kernel_init
from roformer.nn.layers import DTYPES
from roformer.posenc.rope_scaling import mla_softmax_factor


class MLACache(NamedTuple):
  """The latent [B, C, P] (after its norm) and the rotated shared rotary key [B, C, R]."""

  c_BCP: jnp.ndarray
  kr_BCR: jnp.ndarray


class MLAttention(nnx.Module):
  """DeepSeek-V2 attention; parameters carry the logical axes of `Attention`'s."""

  def __init__(self, cfg, *, head_dim, causal, window, dtype, param_dtype, rngs):
    D, H, N = cfg.emb_dim, cfg.num_heads, head_dim
    P, Q, R = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim
    self.causal, self.window, self.global_tokens = causal, window, cfg.global_tokens
    self.impl, self.block, self.dropout_rate = (
      cfg.attention_impl,
      cfg.attention_block,
      attention_dropout(cfg),
    )
    self.head_dim, self.rope_dim, self.dtype = N, R, jnp.dtype(dtype)
    self.softmax_factor = mla_softmax_factor(cfg.posenc.scaling)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bias = dict(use_bias=cfg.use_bias, **common)
    norm = dict(epsilon=cfg.norm_eps, use_fast_variance=False, **common)

    def dense(din, dout, names):
      return nnx.Linear(
        din, dout, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros, names[1:]), **bias,
      )  # fmt: skip

    def up(din, dout, names):
      return nnx.Einsum(
        "BLP,PHK->BLHK", (din, H, dout), None, kernel_init=kernel_init(0, (1, 2), names),
        **common,
      )  # fmt: skip

    if Q:
      self.q_down = dense(D, Q, ("embed", None))
      self.q_norm = nnx.RMSNorm(Q, **norm)
      self.q_up = up(Q, N + R, (None, "heads", "kv"))
    else:
      self.q_down = self.q_norm = None
      self.q_up = up(D, N + R, ("embed", "heads", "kv"))
    self.kv_down = dense(D, P + R, ("embed", None))
    self.kv_norm = nnx.RMSNorm(P, **norm)
    self.kv_up = up(P, 2 * N, (None, "heads", "kv"))
    self.out = nnx.Einsum(
      "...HK,HKD->...D", (H, N, D), (D,) if cfg.use_bias else None,
      kernel_init=kernel_init((0, 1), 2, ("heads", "kv", "embed")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **common,
    )  # fmt: skip

  @classmethod
  def from_config(cls, cfg, spec, *, rngs):
    # One shared rotary key; keys and values come from the latent.
    return cls(
      cfg, head_dim=cfg.head_dim or cfg.emb_dim // cfg.num_heads, causal=spec.causal,
      window=spec.window, dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], rngs=rngs,
    )  # fmt: skip

  @classmethod
  def check_config(cls, cfg, posenc_cls) -> None:
    # Rotary or not, the encoding acts through its hooks, on the rotary part alone.
    if cfg.kv_lora_rank < 1 or cfg.qk_rope_head_dim < 1:
      raise ValueError(
        f"model.attention='mla' needs model.kv_lora_rank > 0 and model.qk_rope_head_dim > 0, "
        f"got {cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}"
      )
    R = cfg.qk_rope_head_dim
    # Its queries and keys are head_dim + R wide.
    head_dim = (cfg.head_dim or cfg.emb_dim // cfg.num_heads) + R
    check_kernel_config(cfg, posenc_cls, head_dim=head_dim)
    if posenc_cls is not None and posenc_cls.rotated_dim(cfg.posenc, R) != R:
      raise ValueError(
        f"posenc.kind={cfg.posenc.kind!r} widens the rotary queries and keys, which "
        "model.attention='mla' does not support (it caches a rotary key of "
        "model.qk_rope_head_dim dims and sizes its values by the keys); use "
        "model.attention='softmax'"
      )
    if cfg.qkv_bias:
      raise ValueError(
        "model.qkv_bias=True biases separate query/key/value projections, which "
        "model.attention='mla' does not have (it projects a joint latent); use model.use_bias"
      )
    if cfg.num_kv_heads not in (0, cfg.num_heads):
      raise ValueError(
        f"model.num_kv_heads={cfg.num_kv_heads} does not apply to model.attention='mla' (keys "
        "and values are expanded per head from one latent); use 0"
      )

  @classmethod
  def rotary_head_dim(cls, cfg, head_dim: int) -> int:
    del head_dim
    return cfg.qk_rope_head_dim

  def qkv(self, x_BLD):
    """-> (queries [B, L, H, N + R], normalised latent [B, L, P], rotary key [B, L, 1, R])."""
    h_BLD = x_BLD if self.q_down is None else self.q_norm(self.q_down(x_BLD))
    q_BLHK = self.q_up(h_BLD)
    ckr_BLX = self.kv_down(x_BLD)
    P = ckr_BLX.shape[-1] - self.rope_dim
    return q_BLHK, self.kv_norm(ckr_BLX[..., :P]), ckr_BLX[..., None, P:]

  def _rotate(self, q_BLHK, kr_BS1R, qpos_BL, kpos_BS, posenc, rotary_state):
    N = self.head_dim
    qr_BLHR, kr_BS1R = posenc.rotate(q_BLHK[..., N:], kr_BS1R, qpos_BL, kpos_BS, rotary_state)
    return jnp.concatenate([q_BLHK[..., :N], qr_BLHR], axis=-1), kr_BS1R

  def _attend_latent(self, kernel, q_BLHK, c_BSP, kr_BS1R, qpos_BL, kpos_BS, **fields):
    """Expands the latent into per-head keys and values, then runs `kernel` on a call of the
    layer's mask and `fields` (`AttentionCall`'s); [B, L, H, N]."""
    N, H = self.head_dim, q_BLHK.shape[2]
    kv_BSHX = self.kv_up(c_BSP.astype(self.dtype))
    kr_BSHR = jnp.broadcast_to(kr_BS1R, (*kr_BS1R.shape[:2], H, self.rope_dim))
    k_BSHK = jnp.concatenate([kv_BSHX[..., :N], kr_BSHR.astype(kv_BSHX.dtype)], axis=-1)
    # The kernels take values as wide as keys: zero rotary columns, dropped from the output.
    v_BSHK = jnp.concatenate([kv_BSHX[..., N:], jnp.zeros_like(kr_BSHR, kv_BSHX.dtype)], axis=-1)
    q_BLHK = q_BLHK * jnp.asarray(self.softmax_factor, q_BLHK.dtype)
    call = AttentionCall(
      causal=self.causal, window=self.window, block=self.block, global_tokens=self.global_tokens,
      **fields,
    )  # fmt: skip
    o_BLHK = kernel(q_BLHK, k_BSHK, v_BSHK, qpos_BL, kpos_BS, call)
    return o_BLHK[..., :N]

  def init_cache(self, batch: int, max_len: int) -> MLACache:
    C = kv_cache.capacity(self.window, max_len)
    P = self.kv_norm.num_features
    return MLACache(
      jnp.zeros((batch, C, P), self.dtype), jnp.zeros((batch, C, self.rope_dim), self.dtype)
    )

  def __call__(
    self, x_BLD, pos_BL, posenc, *, cache: MLACache | None = None, segment_ids_BL=None,
    dropout_key=None, rotary_state=None,
  ):  # fmt: skip
    """-> (heads [B, L, H, N], cache); as `Attention.__call__`, caching only the latent and the
    rotated rotary key."""
    q_BLHK, c_BLP, kr_BL1R = self.qkv(x_BLD)
    q_BLHK, kr_BL1R = self._rotate(q_BLHK, kr_BL1R, pos_BL, pos_BL, posenc, rotary_state)
    if cache is not None:
      cache = MLACache(
        kv_cache.write(cache.c_BCP, c_BLP, pos_BL),
        kv_cache.write(cache.kr_BCR, kr_BL1R[:, :, 0], pos_BL),
      )
      if q_BLHK.shape[1] == 1:
        kpos_BC, kseg_BC = kv_cache.cache_keys(cache.c_BCP.shape[1], pos_BL)
        o_BLHK = self._attend_latent(
          dense_attention, q_BLHK, cache.c_BCP, cache.kr_BCR[:, :, None], pos_BL, kpos_BC,
          qseg_BL=jnp.zeros_like(pos_BL), kseg_BS=kseg_BC, bias_fn=posenc.bias,
        )  # fmt: skip
        return o_BLHK, cache
    o_BLHK = self._attend_latent(
      KERNELS[self.impl], q_BLHK, c_BLP, kr_BL1R, pos_BL, pos_BL, qseg_BL=segment_ids_BL,
      kseg_BS=segment_ids_BL, bias_fn=posenc.bias, bias_factors_fn=posenc.bias_factors,
      dropout_rate=self.dropout_rate, dropout_key=dropout_key,
    )  # fmt: skip
    return o_BLHK, cache
