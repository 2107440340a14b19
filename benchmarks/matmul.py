"""Square-matmul GFLOP/s of XLA (JAX) and, when installed, PyTorch, in float32 and bfloat16.

Why a bfloat16 train step gains or not on a CPU: the step is bounded by its matmuls, and this
table shows what each library's bfloat16 matmul delivers on this machine against its float32 one.
JAX runs with the XLA flags train.py sets (roformer.cpu_flags) unless XLA_FLAGS is given; PyTorch
uses the same number of threads as there are cores. Prints a table; --json writes it.

  JAX_PLATFORMS=cpu python -m benchmarks.matmul [--sizes=256,1024,2048] [--repeats=5] [--json=F]
"""

import json
import os

from absl import app, flags

from benchmarks.bench_step import median_seconds

flags.DEFINE_list("sizes", ["256", "1024", "2048"], "Sides of the square matmuls.")
flags.DEFINE_integer("repeats", 5, "Timed calls per size; the median is reported.")
flags.DEFINE_string("json", "", "Write the results to this JSON file.")
FLAGS = flags.FLAGS
DTYPES = ("float32", "bfloat16")


def jax_gflops(size: int, dtype: str, repeats: int) -> float:
  import jax
  import jax.numpy as jnp

  a = jnp.ones((size, size), dtype)
  f = jax.jit(lambda a, b: a @ b)
  return 2.0 * size**3 / median_seconds(lambda: f(a, a).block_until_ready(), repeats) / 1e9


def torch_gflops(size: int, dtype: str, repeats: int) -> float | None:
  try:
    import torch
  except ImportError:
    return None
  a = torch.ones(size, size, dtype=getattr(torch, dtype))
  return 2.0 * size**3 / median_seconds(lambda: a @ a, repeats) / 1e9


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from roformer.infra import cpu_flags

  cpu_flags.set_default_cpu_flags()  # as train.py does, before JAX starts
  rows = []
  for size in map(int, FLAGS.sizes):
    for dtype in DTYPES:
      rows.append(
        {
          "size": size,
          "dtype": dtype,
          "jax_gflops": jax_gflops(size, dtype, FLAGS.repeats),
          "torch_gflops": torch_gflops(size, dtype, FLAGS.repeats),
        }
      )
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print("| size | dtype | JAX GFLOP/s | PyTorch GFLOP/s |")
  print("|---|---|---|---|")
  for r in rows:
    torch_cell = "not installed" if r["torch_gflops"] is None else f"{r['torch_gflops']:,.0f}"
    print(f"| {r['size']} | {r['dtype']} | {r['jax_gflops']:,.0f} | {torch_cell} |")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
