"""The Forgetting Transformer's forget gate (`model.forget_gate`; FoX, Lin et al. 2025, arXiv
2503.02130): softmax attention whose logits decay with the gates between query and key.

Per head h, a scalar gate from the layer's (normed) input x_t and the logit bias it implies:

  f_t = sigmoid(w_h . x_t + b_h),   c_i = sum_{l <= i} log f_l,   logits_ij += c_i - c_j,

so a key j steps back is weighted by the product of the gates f_{j+1} ... f_i (<= 1): the model
learns, per head and from the content, how fast to forget. As in the paper's code
(`ForgettingAttentionLayer` with fgate_type="full": `fgate_proj = nn.Linear(hidden_size,
num_heads, bias=True)`, weights N(0, 0.02^2), bias 0, `logsigmoid` in float32). The paper's
FoX uses no positional encoding (its `use_rope=False`): set posenc.kind="nope" to run it as the
paper did; any other encoding combines with it.

How the kernels take it: within a query row c_i is one constant added to every logit, and a
softmax is unchanged by a constant added to its row, so only -c_j matters, a bias per key
[B, S, H] (`key_bias_BSH` of the kernels). The blockwise kernels split it into key blocks as they
split the keys (no [L, S] array), and generation caches c of every key beside it (KVCache.c_BCH)
and continues the sum from the cached c of the previous position. c runs over the whole row,
across packed documents too: c_i - c_j within a document is the same, and other documents'
keys are masked. Attention sinks are refused with it: the sink's logit carries no c_i, so the
row constant would no longer cancel, and the paper defines no such combination.

Legend: B batch, L length, D model dim, H query heads.
"""

import jax
import jax.numpy as jnp
from flax import nnx

GATE_INIT_STD = 0.02


class ForgetGate(nnx.Module):
  """log f_t [B, L, H] (float32) from the layer input. Parameters: kernel [D, H]
  ('embed', 'heads'), N(0, 0.02^2); bias [H] ('heads',), zeros."""

  def __init__(self, emb_dim: int, num_heads: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.proj = nnx.Einsum(
      "...D,DH->...H", (emb_dim, num_heads), (num_heads,),
      kernel_init=nnx.with_partitioning(nnx.initializers.normal(GATE_INIT_STD), ("embed", "heads")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("heads",)),
      dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )  # fmt: skip

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    return jax.nn.log_sigmoid(self.proj(x_BLD).astype(jnp.float32))


def cumulative(logf_BLH: jax.Array, c_prev_BH: jax.Array | None = None) -> jax.Array:
  """c_i = c_prev + sum_{l <= i} log f_l: float32 [B, L, H] (c_prev: the cached c of the position
  before the first, or None at position 0)."""
  c_BLH = jnp.cumsum(logf_BLH, axis=1)
  return c_BLH if c_prev_BH is None else c_BLH + c_prev_BH[:, None, :]
