"""Causal self-attention on the CPU, forward and forward + backward: the fused kernel
(`attention_impl=cpu_flash`, what `auto` runs on a CPU), the XLA kernels `auto` runs without it
(dense up to `--block`² scores, chunked beyond), and PyTorch's fused SDPA kernel
(`scaled_dot_product_attention(is_causal=True)`, if torch is installed) on the same inputs.

Milliseconds per call, the median of `--repeats` calls after one untimed call (the compile).
The backward pass is that of sum(o * w) for a fixed random w. JAX runs with the XLA flags
train.py sets (roformer.infra.cpu_flags); PyTorch with as many threads as the machine's cores.

  # the decoder of the speed comparison: 8 x 512 tokens, 4 heads of 64
  JAX_PLATFORMS=cpu python -m benchmarks.cpu_attention
  JAX_PLATFORMS=cpu python -m benchmarks.cpu_attention --batch=1 --lengths=2048,8192 --no_backward
  JAX_PLATFORMS=cpu python -m benchmarks.cpu_attention --smoke   # seconds; what the test runs
"""

import importlib.util
import os

from absl import app, flags

from benchmarks.bench_step import median_seconds

flags.DEFINE_integer("batch", 8, "Sequences per call.")
flags.DEFINE_list("lengths", ["512"], "Sequence lengths.")
flags.DEFINE_integer("heads", 4, "Query heads.")
flags.DEFINE_integer("kv_heads", 0, "Key/value heads (0: as many as the query heads).")
flags.DEFINE_integer("head_dim", 64, "Head dim.")
flags.DEFINE_integer("block", 512, "auto's block: dense up to block² scores, chunked beyond.")
flags.DEFINE_integer("repeats", 10, "Timed calls per cell; the median is reported.")
flags.DEFINE_bool("backward", True, "Also time forward + backward.")
flags.DEFINE_bool("smoke", False, "2 x 64 tokens, 2 heads of 16, 2 repeats (a test runs this).")
FLAGS = flags.FLAGS


def _jax_kernels(batch, length, heads, kv_heads, head_dim, block):
  """{name: (forward, forward + backward)} of the JAX kernels, each a no-argument callable."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from roformer.nn.attention import kernels
  from roformer.nn.attention.call import AttentionCall
  from roformer.nn.attention.kernels import cpu_flash

  r = np.random.default_rng(0)
  shapes = [(batch, length, h, head_dim) for h in (heads, kv_heads, kv_heads, heads)]
  q, k, v, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes)
  pos = jnp.broadcast_to(jnp.arange(length), (batch, length))

  call = AttentionCall(causal=True, block=block)

  def xla(q, k, v):  # what auto runs without the fused kernel
    if length * length <= block * block:
      return kernels.dense_attention(q, k, v, pos, pos, call)
    return kernels.chunked_attention(q, k, v, pos, pos, call)

  def flash(q, k, v):
    return cpu_flash.cpu_flash_attention(q, k, v, pos, pos, call)

  out = {}
  for name, fn in (("cpu_flash", flash), ("XLA kernels", xla)):
    fwd = jax.jit(fn)
    grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))
    out[name] = (
      lambda fwd=fwd: jax.block_until_ready(fwd(q, k, v)),
      lambda grad=grad: jax.block_until_ready(grad(q, k, v)),
    )
  return out, (q, k, v, w)


def _torch_sdpa(q, k, v, w):
  """(forward, forward + backward) of PyTorch's SDPA on the same arrays, or None without torch."""
  if importlib.util.find_spec("torch") is None:
    return None
  import numpy as np
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  # [B, L, heads, K] -> [B, heads, L, K], SDPA's layout; grouped keys repeated per query head.
  R = q.shape[2] // k.shape[2]
  tq, tk, tv, tw = (
    torch.tensor(np.asarray(x)).transpose(1, 2).contiguous() for x in (q, k, v, w)
  )  # fmt: skip
  tk, tv = (x.repeat_interleave(R, dim=1) for x in (tk, tv))
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def forward():
    with torch.no_grad():
      sdpa(tq, tk, tv, is_causal=True)

  leaves = [x.clone().requires_grad_() for x in (tq, tk, tv)]

  def backward():
    (sdpa(*leaves, is_causal=True) * tw).sum().backward()

  return forward, backward


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from roformer.infra import cpu_flags

  # As train.py does, before JAX starts, but with glibc's default malloc: PyTorch's SDPA runs
  # in the same process, as its users run it (roformer.infra.cpu_flags.keep_freed_host_memory).
  cpu_flags.set_default_cpu_flags(keep_freed_memory=False)
  batch, lengths, heads, head_dim = (
    FLAGS.batch,
    [int(n) for n in FLAGS.lengths],
    FLAGS.heads,
    FLAGS.head_dim,
  )
  repeats = FLAGS.repeats
  if FLAGS.smoke:
    batch, lengths, heads, head_dim, repeats = 2, [64], 2, 16, 2
  kv_heads = FLAGS.kv_heads or heads
  print(f"batch {batch}, {heads} query heads, {kv_heads} key/value heads of {head_dim}, float32")
  columns = ["forward (ms)"] + (["forward + backward (ms)"] if FLAGS.backward else [])
  print("| L | kernel | " + " | ".join(columns) + " |")
  print("|---|---|" + "---|" * len(columns))
  for length in lengths:
    jax_fns, arrays = _jax_kernels(batch, length, heads, kv_heads, head_dim, FLAGS.block)
    rows = dict(jax_fns)
    if (sdpa := _torch_sdpa(*arrays)) is not None:
      rows["PyTorch SDPA"] = sdpa
    for name, fns in rows.items():
      cells = [f"{1e3 * median_seconds(fn, repeats):,.1f}" for fn in fns[: len(columns)]]
      print(f"| {length} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  app.run(main)
