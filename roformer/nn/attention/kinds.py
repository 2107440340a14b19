"""The registry of attention kinds (`model.attention`): softmax, linear, multi-head latent.

Every kind is a module built by `from_config` and used by the model's blocks through the same
methods:

- `qkv(x_BLD)` -> a tuple of projections, `attend(*qkv, pos_BL, posenc, ...)` -> [B, L, H, K],
  `out(o_BLHK)` -> [B, L, D]: the full-sequence forward pass (training, evaluation, prefill).
- `init_cache(batch, max_len)` and `decode(x_BLD, pos_BL, posenc, cache, rotary_state=...)` ->
  ([B, L, H, K], cache): cached generation (L new tokens; L > 1 only from an empty cache).
- `check_config(cfg, posenc_cls)` (classmethod): combinations this kind cannot honour.
- `rotary_head_dim(cfg, head_dim)` (classmethod): the width the encoding's `rotate` acts on.

Positions reach every kind only through the encoding's hooks (prepare/rotate/bias/embed).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from roformer.nn.attention import kv_cache
from roformer.nn.attention.kernels import KERNELS, dense_attention
from roformer.nn.attention.linear import LinearAttention
from roformer.nn.attention.mla import MLAttention
from roformer.nn.attention.softmax import Attention


class SoftmaxAttention(Attention):
  """Softmax attention (`roformer.attention.Attention`) with a KV cache for generation.

  The cache holds `num_kv_heads` heads (GQA/MQA caches are H/G times smaller) and, for a
  sliding window w shorter than the generated length, w slots used as a ring buffer.
  """

  def __init__(self, *args, dtype=jnp.float32, **kwargs):
    super().__init__(*args, dtype=dtype, **kwargs)
    self.dtype = jnp.dtype(dtype)

  @classmethod
  def from_config(cls, cfg, *, head_dim, num_kv_heads, causal, window, dtype, param_dtype, rngs):
    return cls(
      cfg.emb_dim,
      cfg.num_heads,
      head_dim,
      num_kv_heads=num_kv_heads,
      causal=causal,
      use_bias=cfg.use_bias,
      dropout_rate=cfg.dropout_rate,
      impl=cfg.attention_impl,
      block=cfg.attention_block,
      window=window,
      window_kind=cfg.attention_window_kind,
      global_tokens=cfg.global_tokens,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  @classmethod
  def check_config(cls, cfg, posenc_cls) -> None:
    del cfg, posenc_cls

  @classmethod
  def rotary_head_dim(cls, cfg, head_dim: int) -> int:
    del cfg
    return head_dim

  def init_cache(self, batch: int, max_len: int) -> kv_cache.KVCache:
    """An empty cache for generating up to `max_len` tokens (window slots when shorter)."""
    _, G, K = self.key.kernel.shape
    shape = (batch, kv_cache.capacity(self.window, max_len), G, K)
    return kv_cache.KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

  def decode(self, x_BLD, pos_BL, posenc, cache: kv_cache.KVCache, *, rotary_state):
    """Attention of L new tokens at `pos_BL` over the cache; returns (o [B, L, H, K], cache).

    `rotary_state` is the generation's (fixed for all its steps), so cached keys are stored
    rotated. L > 1 is the prefill of an empty cache: the new tokens attend to each other as in a
    full forward pass and the last slots' worth of them are written. L = 1 is a decode step: the
    new key is written, then the query attends to every filled slot.
    """
    q_BLHK, k_BLGK, v_BLGK = self.qkv(x_BLD)
    q_BLHK, k_BLGK = posenc.rotate(q_BLHK, k_BLGK, pos_BL, pos_BL, rotary_state)
    cache = kv_cache.KVCache(
      kv_cache.write(cache.k_BCGK, k_BLGK, pos_BL), kv_cache.write(cache.v_BCGK, v_BLGK, pos_BL)
    )
    common = dict(causal=True, window=self.window, bias_fn=posenc.bias)
    if q_BLHK.shape[1] > 1:
      o_BLHK = KERNELS[self.impl](
        q_BLHK, k_BLGK, v_BLGK, pos_BL, pos_BL, block=self.block, **common
      )
      return o_BLHK, cache
    kpos_BC, kseg_BC = kv_cache.cache_keys(cache.k_BCGK.shape[1], pos_BL)
    o_BLHK = dense_attention(
      q_BLHK,
      cache.k_BCGK,
      cache.v_BCGK,
      pos_BL,
      kpos_BC,
      qseg_BL=jnp.zeros_like(pos_BL),
      kseg_BS=kseg_BC,
      **common,
    )
    return o_BLHK, cache


ATTENTIONS: dict[str, type[nnx.Module]] = {
  "softmax": SoftmaxAttention,
  "linear": LinearAttention,
  "mla": MLAttention,
}


def make_attention(cfg, **kwargs) -> nnx.Module:
  """Builds `ATTENTIONS[cfg.attention]` for one layer (keyword arguments as `from_config`)."""
  return ATTENTIONS[cfg.attention].from_config(cfg, **kwargs)
