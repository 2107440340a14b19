"""Query temperature (`posenc.query_scale`): each query multiplied by a function of its position.

Multiplying a query by t(n) multiplies all its logits by t(n): a softmax temperature 1 / t(n)
that sharpens attention as the context grows. Only queries change, after rotation and QK-norm,
so every kernel (dense, chunked, banded), every window and the KV cache (keys untouched) honour
it without knowing of it.

n = position + 1 is the number of keys a causal query at that position sees (positions restart
per packed document, so n counts its own document's keys); for that reason these are decoder
options. The factors (float32):

- "logn" (Qwen, `modeling_qwen.py`: `logn_list = [log(i, seq_length) if i > seq_length else 1
  for i in range(1, 32768)]`, indexed by the 0-based position, so i = n):
  t(n) = log_{L0}(n) = ln n / ln L0 for n > L0, else 1; L0 the training length.
- "ssmax" (Nakanishi 2025, Scalable-Softmax, arXiv 2501.19399, eq. 2: softmax(s log(n) z)):
  t(n) = s_h ln n with s_h learned per head (and per layer), initialised at 0.43, the value of
  the paper's experiments; the first position (n = 1) gets t = 0 and attends to its only key.
- "llama4" (Hugging Face transformers `Llama4TextAttention`, `attn_temperature_tuning`):
  t(n) = 1 + beta ln(floor(n / floor_scale) + 1), beta = `attn_scale` = 0.1 and floor_scale =
  8192 by default; 1 up to position floor_scale - 2. Llama 4 applies it to its NoPE layers only
  (`posenc.query_scale_kinds="nope"`).

Legend: B batch, L length, H heads, K head dim.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.config import PosEncConfig

QUERY_SCALES = ("none", "logn", "ssmax", "llama4")
SSMAX_INIT = 0.43


def _n(pos_BL: jax.Array) -> jax.Array:
  """float32 n = position + 1, the keys a causal query sees."""
  return pos_BL.astype(jnp.float32) + 1.0


def logn_scale(pos_BL: jax.Array, train_len: int) -> jax.Array:
  """Qwen's log_{L0}(n) for n > L0, else 1: float32 [B, L]."""
  n_BL = _n(pos_BL)
  return jnp.where(n_BL > train_len, jnp.log(n_BL) / jnp.log(float(train_len)), 1.0)


def llama4_scale(pos_BL: jax.Array, beta: float, floor_scale: float) -> jax.Array:
  """Llama 4's 1 + beta ln(floor((pos + 1) / floor_scale) + 1): float32 [B, L]."""
  return 1.0 + beta * jnp.log(jnp.floor(_n(pos_BL) / floor_scale) + 1.0)


def resolve_query_scale_len(values: dict, *, train_len: int) -> dict:
  """posenc values with logn's query_scale_len 0 replaced by the pretraining length: log_L0(n)
  is 1 up to that length, also in a fine-tune at another length."""
  if values.get("query_scale", "none") == "logn" and not values.get("query_scale_len", 0):
    values = {**values, "query_scale_len": train_len}
  return values


def check_query_scale(cfg: PosEncConfig, *, causal: bool) -> None:
  """Raises ValueError naming the field for a query temperature that cannot be honoured."""
  if cfg.query_scale not in QUERY_SCALES:
    raise ValueError(f"posenc.query_scale={cfg.query_scale!r} is not one of {QUERY_SCALES}")
  if cfg.query_scale == "none":
    return
  if not causal:
    raise ValueError(
      f"posenc.query_scale={cfg.query_scale!r} needs a causal decoder (model.kind='decoder'): "
      "it reads the number of keys a query sees as its position + 1, true only under a causal mask"
    )
  if cfg.query_scale == "logn" and cfg.query_scale_len < 2:
    raise ValueError(
      f"posenc.query_scale_len={cfg.query_scale_len} must be >= 2 for posenc.query_scale='logn' "
      "(the training length L0 of log_L0(n); 0 means data.seq_len in a run config)"
    )
  if not cfg.query_scale_floor > 0:
    raise ValueError(f"posenc.query_scale_floor={cfg.query_scale_floor} must be > 0")


class QueryScale(nnx.Module):
  """Multiplies queries [B, L, H, K] by t(n) of their positions (`posenc.query_scale`).

  Parameters: with "ssmax", `s` [H] ('heads',), one learned factor per head.
  """

  def __init__(self, cfg: PosEncConfig, *, num_heads: int, param_dtype=jnp.float32, rngs):
    self.kind = cfg.query_scale
    self.train_len = cfg.query_scale_len
    self.beta = cfg.query_scale_beta
    self.floor_scale = cfg.query_scale_floor
    init = nnx.with_partitioning(nnx.initializers.constant(SSMAX_INIT), ("heads",))
    self.s = (
      nnx.Param(init(rngs.params(), (num_heads,), param_dtype)) if self.kind == "ssmax" else None
    )

  def factor(self, pos_BL: jax.Array) -> jax.Array:
    """float32 t(n): [B, L, 1] (one per position), or [B, L, H] for ssmax."""
    if self.kind == "logn":
      return logn_scale(pos_BL, self.train_len)[:, :, None]
    if self.kind == "llama4":
      return llama4_scale(pos_BL, self.beta, self.floor_scale)[:, :, None]
    return jnp.log(_n(pos_BL))[:, :, None] * self.s[...].astype(jnp.float32)[None, None, :]

  def __call__(self, q_BLHK: jax.Array, pos_BL: jax.Array) -> jax.Array:
    t_BLH1 = self.factor(pos_BL)[..., None]
    return (q_BLHK.astype(jnp.float32) * t_BLH1).astype(q_BLHK.dtype)
