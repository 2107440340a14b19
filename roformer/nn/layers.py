"""The model's parameterised building blocks from its config: embeddings, dense layers, norms."""

import functools

import jax
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


def stacked_dense(x_ND, layers):
  """The outputs of dense layers that read the same input [N, D], as one GEMM.

  Each layer (an nnx.Linear with kernel [D, F] and bias [F], all of one shape) gives
  x @ kernel + bias, as it would alone. Their kernels are stacked on a new last axis, [D, F, n],
  and merged into one [D, F n] matrix, so the product is one GEMM: its backward pass is one GEMM
  for the input's gradient (instead of n GEMMs and the sum of their outputs) and one for the
  kernels', over the layers' output gradients written once, interleaved. Each parameter keeps
  its own shape, name and sharding: the new axis is the minor one, so merging it into F keeps
  F's sharding and the SPMD partitioner moves no data for it.
  """
  first = layers[0]
  dtype = first.dtype or jnp.result_type(x_ND, first.kernel[...])  # nnx.Linear's promotion
  kernel_DFC = jnp.stack([layer.kernel[...] for layer in layers], axis=-1).astype(dtype)
  D, F, C = kernel_DFC.shape
  y_NFC = jnp.dot(x_ND.astype(dtype), kernel_DFC.reshape(D, F * C)).reshape(-1, F, C)
  if first.bias is not None:
    bias_FC = jnp.stack([layer.bias[...] for layer in layers], axis=-1).astype(dtype)
    y_NFC = y_NFC + bias_FC[None]
  # split (not indexing): its transpose writes the output gradients in one buffer.
  return tuple(y_NF1[..., 0] for y_NF1 in jnp.split(y_NFC, C, axis=-1))


@jax.custom_vjp
def shared_input_dense(x_ND, kernels):
  """x @ kernel for each [D, F_i] kernel of `kernels` (a tuple), all reading one input [N, D].

  The weights' gradients x^T dy_i contract the tokens, the major axis of both operands. XLA:CPU
  runs that either in place, slower than a plain GEMM (the TN form of
  `benchmarks/attention_products.py`), or, where it can fold a layout change into the producer
  of dy_i, by writing each dy_i a second time, transposed. Here the forward pass writes x^T
  once (behind a barrier, so XLA keeps it rather than folding the transpose back into the
  products) and every weight gradient is a plain [D, N] x [N, F_i] GEMM.
  """
  return tuple(jnp.dot(x_ND, kernel_DF) for kernel_DF in kernels)


def _shared_input_dense_fwd(x_ND, kernels):
  xT_DN = jax.lax.optimization_barrier(x_ND.T)
  return shared_input_dense(x_ND, kernels), (xT_DN, kernels)


def _shared_input_dense_bwd(residuals, dys):
  xT_DN, kernels = residuals
  dx_ND = functools.reduce(
    jnp.add, [jnp.dot(dy_NF, kernel_DF.T) for dy_NF, kernel_DF in zip(dys, kernels, strict=True)]
  )
  return dx_ND.astype(xT_DN.dtype), tuple(
    jnp.dot(xT_DN, dy_NF).astype(kernel_DF.dtype)
    for dy_NF, kernel_DF in zip(dys, kernels, strict=True)
  )


shared_input_dense.defvjp(_shared_input_dense_fwd, _shared_input_dense_bwd)


@jax.custom_vjp
def swiglu(gate_NF, up_NF):
  """silu(gate) * up, SwiGLU's gated activation, with a hand-written backward pass.

  Autodiff of jax.nn.silu keeps sigmoid(gate) and silu(gate) and writes each product of the
  forward and backward passes as a pass of its own over [N, F]; here the forward pass is one
  pass that keeps only its inputs, and the backward pass one that recomputes the sigmoid:
  d gate = dh up s (1 + gate (1 - s)), d up = dh gate s, with s = sigmoid(gate).
  """
  return jax.nn.silu(gate_NF) * up_NF


def _swiglu_fwd(gate_NF, up_NF):
  return swiglu(gate_NF, up_NF), (gate_NF, up_NF)


def _swiglu_bwd(residuals, dh_NF):
  # Behind a barrier, so XLA cannot merge this pass's sigmoid with the forward pass's (which
  # would make the forward pass write it out for the backward pass to read).
  gate_NF, up_NF = jax.lax.optimization_barrier(residuals)
  s_NF = jax.nn.sigmoid(gate_NF)
  silu_NF = gate_NF * s_NF
  dgate_NF = dh_NF * up_NF * (s_NF + silu_NF * (1 - s_NF))
  return dgate_NF.astype(gate_NF.dtype), (dh_NF * silu_NF).astype(up_NF.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
