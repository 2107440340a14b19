"""GFLOP/s of attention's batched products on XLA:CPU in each operand form.

Why `block_pairs.py` computes the scores transposed: a batched product [B, G] x ([rows, inner]
x [inner, cols]) runs at a speed that depends on which axis of each operand it contracts. This
table times the three forms attention's six products take (NN: contract the left operand's
minor axis and the right one's major axis; NT: both minor, as q k^T; TN: both major, as
ds^T q) at the shapes of the dense kernel's causal blocks (batch 8 x 4 heads, head dim 64).
JAX runs with the XLA flags train.py sets (roformer.infra.cpu_flags) unless XLA_FLAGS is given.

  JAX_PLATFORMS=cpu python -m benchmarks.attention_products [--rows=128] [--keys=128,512]
"""

import os

from absl import app, flags

from benchmarks.bench_step import median_seconds

flags.DEFINE_integer("rows", 128, "Query rows of a block (M).")
flags.DEFINE_list("keys", ["128", "512"], "Key counts (E): a pair of blocks, and a prefix.")
flags.DEFINE_integer("head_dim", 64, "Head dim (K).")
flags.DEFINE_integer("repeats", 20, "Timed calls per product; the median is reported.")
FLAGS = flags.FLAGS
BATCH, HEADS = 8, 4

# (product, form, einsum, left operand's [rows, inner] roles, right operand's roles)
FORMS = [
  ("scores q k^T", "NT", "bgmk,bgsk->bgms", "mk", "sk"),
  ("scores^T k q^T", "NN", "bgsk,bgkm->bgsm", "sk", "km"),
  ("values p v", "NN", "bgms,bgsk->bgmk", "ms", "sk"),
  ("key grads ds^T q", "TN", "bgms,bgmk->bgsk", "ms", "mk"),
  ("key grads ds^T q, ds^T stored", "NN", "bgsm,bgmk->bgsk", "sm", "mk"),
]


def gflops(spec: str, left: str, right: str, sizes: dict, repeats: int) -> float:
  import jax
  import jax.numpy as jnp

  x = jnp.ones((BATCH, HEADS, *(sizes[a] for a in left)), jnp.float32)
  y = jnp.ones((BATCH, HEADS, *(sizes[a] for a in right)), jnp.float32)
  f = jax.jit(lambda x, y: jnp.einsum(spec, x, y))
  flop = 2.0 * BATCH * HEADS * sizes["m"] * sizes["s"] * sizes["k"]
  return flop / median_seconds(lambda: f(x, y).block_until_ready(), repeats) / 1e9


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from roformer.infra import cpu_flags

  cpu_flags.set_default_cpu_flags()  # as train.py does, before JAX starts
  keys = [int(k) for k in FLAGS.keys]
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"batch {BATCH} x {HEADS} heads, M = {FLAGS.rows} rows, K = {FLAGS.head_dim}")
  print("| product | form | " + " | ".join(f"E = {e} (GFLOP/s)" for e in keys) + " |")
  print("|---|---|" + "---|" * len(keys))
  for name, form, spec, left, right in FORMS:
    cells = []
    for e in keys:
      sizes = {"m": FLAGS.rows, "s": e, "k": FLAGS.head_dim}
      rate = gflops(spec, left, right, sizes, FLAGS.repeats)
      cells.append(f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}")  # 3 digits at least
    print(f"| {name} | {form} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  app.run(main)
