"""The model's parameterised building blocks from its config: embeddings, dense layers, norms."""

import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def embed(cfg, num, dim, rngs, stddev=0.02):
  """A [num, dim] embedding table, N(0, stddev^2), axes ('vocab', 'embed')."""
  return nnx.Embed(
    num,
    dim,
    dtype=DTYPES[cfg.dtype],
    param_dtype=DTYPES[cfg.param_dtype],
    embedding_init=nnx.with_partitioning(nnx.initializers.normal(stddev), ("vocab", "embed")),
    rngs=rngs,
  )


def linear(cfg, din, dout, names, rngs, use_bias=None):
  """A dense layer din -> dout with logical axis `names`, LeCun-normal kernel, zero bias."""
  return nnx.Linear(
    din,
    dout,
    use_bias=cfg.use_bias if use_bias is None else use_bias,
    dtype=DTYPES[cfg.dtype],
    param_dtype=DTYPES[cfg.param_dtype],
    kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
    bias_init=nnx.with_partitioning(nnx.initializers.zeros, names[1:]),
    rngs=rngs,
  )


def norm(cfg, dim, rngs):
  """LayerNorm or RMSNorm (`model.norm`) over dim, scale (and bias) on the "embed" axis."""
  kwargs = dict(
    epsilon=cfg.norm_eps,
    dtype=DTYPES[cfg.dtype],
    param_dtype=DTYPES[cfg.param_dtype],
    use_fast_variance=False,
    scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
    rngs=rngs,
  )
  if cfg.norm == "rmsnorm":
    return nnx.RMSNorm(dim, **kwargs)
  return nnx.LayerNorm(
    dim, bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **kwargs
  )


def tokens(x_BL):
  """[B, L, ...] -> [B * L, ...]: the tokens as one axis, for position-wise dense layers.

  The gradient of a dense layer's weights contracts its input and output gradient over the
  tokens. Over one axis XLA:CPU runs that as one GEMM reading both in place; over two (B and L)
  it first copies both into a transposed layout, which costs as much as the GEMM itself.
  """
  return x_BL.reshape(-1, *x_BL.shape[2:])
