"""QK-norm (`model.qk_norm`): queries and keys normalised before the logits.

- "rmsnorm" (Qwen3, Gemma 3): RMSNorm over each head's K dims with a learned scale [K] shared by
  the heads, one for queries and one for keys, before the rotation (Hugging Face transformers
  `Qwen3Attention`: `q_norm(q_proj(x).view(..., head_dim))`, then RoPE; Qwen3's comment: "unlike
  olmo, only on the head dim"). Its eps is `model.norm_eps` (Qwen3's `rms_norm_eps`). Each head
  leaves with norm sqrt(K) times its scale, so a head's logit is bounded by
  K * max|scale_q| * max|scale_k| / sqrt(K) whatever the input.
- "rmsnorm_whole" (OLMo 2, `Olmo2Attention`: `q_norm = Olmo2RMSNorm(num_heads * head_dim)`
  applied to `q_proj(x)` before the heads are split, then RoPE): RMSNorm over the whole query
  projection (H * K values) and the whole key projection (G * K), with learned scales [H, K] and
  [G, K]. Only the concatenation of the heads has norm sqrt(H K) (sqrt(G K) for keys): one head
  may carry most of it, so a head's logit is bounded only by sqrt(H G) times the per-head bound.
- "l2" (Llama 4, `Llama4TextL2Norm`, applied after RoPE): x / sqrt(mean(x^2) + eps) in float32,
  no learned scale. Despite its name it divides by the root mean square, so a normalised head
  has norm sqrt(K), not 1 (logits keep the scale 1/sqrt(K) expects); eps is `model.norm_eps`
  (Llama 4 passes `rms_norm_eps`).

Legend: B batch, L length, H heads (G for keys), K head dim.
"""

import jax
import jax.numpy as jnp
from flax import nnx

QK_NORMS = ("none", "rmsnorm", "rmsnorm_whole", "l2")


def l2_norm(x_BLHK: jax.Array, eps: float) -> jax.Array:
  """Llama 4's parameter-free x * rsqrt(mean(x^2) + eps) over the last axis, in float32."""
  x = x_BLHK.astype(jnp.float32)
  return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(x_BLHK.dtype)


class WholeRMSNorm(nnx.Module):
  """OLMo 2's RMSNorm over a whole projection: the mean square is taken over the heads and the
  head dim together (the last two axes), in float32, then each of the H * K values takes its own
  learned scale. The scale is kept as [H, K] on the ('heads', 'kv') axes, so that it shards with
  the heads like the projection it follows."""

  def __init__(self, num_heads: int, head_dim: int, eps: float, dtype, param_dtype, rngs):
    init = nnx.with_partitioning(nnx.initializers.ones, ("heads", "kv"))
    self.scale = nnx.Param(init(rngs.params(), (num_heads, head_dim), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x_BLHK: jax.Array) -> jax.Array:
    x = x_BLHK.astype(jnp.float32)
    ms_BL11 = jnp.mean(x * x, axis=(-2, -1), keepdims=True)
    scale_11HK = self.scale[...].astype(jnp.float32)[None, None]
    y = x * jax.lax.rsqrt(ms_BL11 + self.eps) * scale_11HK
    return y.astype(self.dtype or x_BLHK.dtype)


def qk_norm_layers(kind: str, heads: tuple[int, int], head_dim: int, eps, dtype, param_dtype, rngs):
  """The (query norm, key norm) pair of `kind` for `heads` = (H, G) query and key heads: for
  "rmsnorm" per-head RMSNorms with scales [K] on the 'kv' axis; for "rmsnorm_whole" OLMo 2's
  norms over the whole projections, scales [H, K] and [G, K]; (None, None) for the other kinds.
  Scales start at 1."""
  if kind == "rmsnorm_whole":
    return tuple(WholeRMSNorm(n, head_dim, eps, dtype, param_dtype, rngs) for n in heads)
  if kind != "rmsnorm":
    return (None, None)

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
