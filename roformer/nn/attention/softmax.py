"""The softmax attention layer: q/k/v/out projections (MHA/GQA/MQA) over explicit positions.

Dimension legend as kernels.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.nn.attention.kernels import KERNELS

if TYPE_CHECKING:
  from roformer.posenc import PosEnc


def kernel_init(in_axis, out_axis, names):
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
    qkv_init = kernel_init(0, (1, 2), ("embed", "heads", "kv"))
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
      kernel_init=kernel_init((0, 1), 2, ("heads", "kv", "embed")),
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
