"""QK-norm (`model.qk_norm`): queries and keys normalised per head over the head dim.

- "rmsnorm" (OLMo 2, Qwen3, Gemma 3): RMSNorm over each head's K dims with a learned scale [K]
  shared by the heads, one for queries and one for keys, before the rotation (Hugging Face
  transformers `Qwen3Attention`: `q_norm(q_proj(x).view(..., head_dim))`, then RoPE). Its eps is
  `model.norm_eps` (Qwen3's `rms_norm_eps`).
- "l2" (Llama 4, `Llama4TextL2Norm`, applied after RoPE): x / sqrt(mean(x^2) + eps) in float32,
  no learned scale. Despite its name it divides by the root mean square, so a normalised head
  has norm sqrt(K), not 1 (logits keep the scale 1/sqrt(K) expects); eps is `model.norm_eps`
  (Llama 4 passes `rms_norm_eps`).

Legend: B batch, L length, H heads, K head dim.
"""

import jax
import jax.numpy as jnp
from flax import nnx

QK_NORMS = ("none", "rmsnorm", "l2")


def l2_norm(x_BLHK: jax.Array, eps: float) -> jax.Array:
  """Llama 4's parameter-free x * rsqrt(mean(x^2) + eps) over the last axis, in float32."""
  x = x_BLHK.astype(jnp.float32)
  return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(x_BLHK.dtype)


def qk_norm_layers(head_dim: int, eps: float, dtype, param_dtype, rngs) -> tuple:
  """The "rmsnorm" pair (query norm, key norm): scales [K] on the 'kv' axis, initialised at 1."""

  def make():
    return nnx.RMSNorm(
      head_dim,
      epsilon=eps,
      dtype=dtype,
      param_dtype=param_dtype,
      use_fast_variance=False,
      scale_init=nnx.with_partitioning(nnx.initializers.ones, ("kv",)),
      rngs=rngs,
    )

  return make(), make()
