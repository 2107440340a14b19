"""Time and memory of sliding-window attention against length: the chunked kernel's window band.

For each length L, times the forward pass of `chunked_attention` with a window w (the banded
kernel, which visits only the key blocks inside the window) and, up to --full_max, the same
kernel without a window (every key block), and prints the XLA temporary buffers of the compiled
windowed kernel. Windowed time and memory per token should stay flat as L grows (O(L * w)),
while full attention's time per token grows with L.

  JAX_PLATFORMS=cpu python -m benchmarks.window [--lengths=1024,...,32768] [--window=256]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.kernels import chunked_attention


def _inputs(length, heads, head_dim):
  rng = np.random.default_rng(0)
  q, k, v = (
    jnp.asarray(rng.standard_normal((1, length, heads, head_dim)), jnp.float32) for _ in range(3)
  )
  return q, k, v, jnp.arange(length, dtype=jnp.int32)[None]


def _measure(fn, args, repeats):
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))  # warm-up
  start = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(compiled(*args))
  seconds = (time.perf_counter() - start) / repeats
  return seconds, compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
  parser.add_argument("--window", type=int, default=256)
  parser.add_argument("--block", type=int, default=256)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=32)
  parser.add_argument("--full_max", type=int, default=8192, help="longest full-attention run")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()

  def windowed(q, k, v, pos):
    call = AttentionCall(causal=True, window=args.window, block=args.block)
    return chunked_attention(q, k, v, pos, pos, call)

  def full(q, k, v, pos):
    return chunked_attention(q, k, v, pos, pos, AttentionCall(causal=True, block=args.block))

  print(f"causal, w={args.window}, block={args.block}, H={args.heads}, K={args.head_dim}, B=1")
  header = "| L | windowed ms | windowed us/token | windowed temp MiB | full ms | full us/token |"
  print(header)
  print("|---|---|---|---|---|---|")
  for length in (int(x) for x in args.lengths.split(",")):
    inputs = _inputs(length, args.heads, args.head_dim)
    w_s, w_mem = _measure(windowed, inputs, args.repeats)
    if length <= args.full_max:
      f_s, _ = _measure(full, inputs, args.repeats)
      full_cols = f"{f_s * 1e3:.1f} | {f_s / length * 1e6:.2f}"
    else:
      full_cols = "- | -"
    print(
      f"| {length} | {w_s * 1e3:.1f} | {w_s / length * 1e6:.2f} | {w_mem / 2**20:.2f} | "
      f"{full_cols} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
