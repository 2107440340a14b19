"""Attention sinks (`model.attention_sinks`): a learned logit per query head that joins the softmax
denominator as an extra key with no value (gpt-oss).

For query head h with logits z_j over its visible keys and sink logit s_h,

  p_j = exp(z_j) / (exp(s_h) + sum_k exp(z_k)),    o = sum_j p_j v_j,

so the weights sum to 1 - p_sink < 1: a head can put weight on "nothing" instead of being forced
to spread it over keys (the role the first tokens play as implicit sinks in models without
one). This is Hugging Face transformers' `GptOssAttention`: `sinks` [num_attention_heads],
concatenated as a last column to the scaled, masked logits before the softmax and dropped after
it (`eager_attention_forward`), initialised N(0, initializer_range^2) with initializer_range
0.02 (`GptOssPreTrainedModel._init_weights`). The sink is in the units of the scaled logits
(after 1 / sqrt(K), the positional bias and the mask), and takes no part in dropout's draw.

Every kernel honours it: the dense kernel adds exp(s_h - m) to each row's denominator (the
row max m taken over the sink too), and the blockwise kernels start their online softmax from
the sink as if it were a key block already seen (running max s_h, running sum 1, no value). A
query with no visible key still gets zeros, now with all its weight on the sink.

Legend: H query heads, G key/value heads, R = H // G.
"""

import jax
import jax.numpy as jnp
from flax import nnx

SINK_INIT_STD = 0.02


def sink_param(num_heads: int, param_dtype, rngs: nnx.Rngs) -> nnx.Param:
  """The sink logits [H] ('heads',), one per query head."""
  init = nnx.with_partitioning(nnx.initializers.normal(SINK_INIT_STD), ("heads",))
  return nnx.Param(init(rngs.params(), (num_heads,), param_dtype))


def grouped(sink_H: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
  """float32 [G, R] sink logits in the kernels' head grouping (query head h = g * R + r)."""
  if sink_H is None:
    return None
  return sink_H.astype(jnp.float32).reshape(num_kv_heads, -1)
