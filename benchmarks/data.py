"""Speed of training-batch production (tokens/s) on the pystdlib corpus; prints a table.

  python -m benchmarks.data [--steps=2000] [--global_batch_size=16] [--seq_len=512]

The first run trains the BPE tokenizer and tokenizes the corpus (cached afterwards); the table
times only TrainBatches.batch, which should be far faster than any training step.
"""

import argparse
import logging
import os
import time

from roformer import data
from roformer.data.sources import cache_root

CASES = (("decoder", False), ("decoder", True), ("encoder", False))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--global_batch_size", type=int, default=16)
  parser.add_argument("--seq_len", type=int, default=512)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--tokenizers", default="bytes,bpe")
  args = parser.parse_args()
  logging.basicConfig(level=logging.WARNING)

  rows = []
  for tokenizer in args.tokenizers.split(","):
    cfg = data.DataConfig(tokenizer=tokenizer, vocab_size=args.vocab_size, seq_len=args.seq_len)
    # A fixed workdir, so the BPE tokenizer is trained once and then reused with its cache.
    workdir = os.path.join(cache_root(cfg), "benchmark_workdir", tokenizer)
    start = time.perf_counter()
    corpus = data.load_corpus(cfg, workdir=workdir, splits=("train",))
    load_s = time.perf_counter() - start
    num_tokens = len(corpus.tokens("train"))
    for kind, pack in CASES:
      start = time.perf_counter()
      batches = data.TrainBatches(
        corpus,
        data.DataConfig(seq_len=args.seq_len, pack=pack),
        model_kind=kind,
        global_batch_size=args.global_batch_size,
        seed=0,
      )
      setup_s = time.perf_counter() - start
      batches.batch(0)  # warm the epoch permutation and the page cache
      start = time.perf_counter()
      for step in range(args.steps):
        batches.batch(step)
      elapsed = time.perf_counter() - start
      tokens_per_s = args.steps * args.global_batch_size * args.seq_len / elapsed
      name = f"{kind}{' packed' if pack else ''}"
      rows.append(
        (tokenizer, name, num_tokens, load_s, setup_s, 1e3 * elapsed / args.steps, tokens_per_s)
      )

  print(
    f"\nTrainBatches.batch on pystdlib: global_batch_size={args.global_batch_size}, "
    f"seq_len={args.seq_len}, {args.steps} steps, 1 process\n"
  )
  header = (
    "tokenizer",
    "batches",
    "train tokens",
    "load_corpus s",
    "setup s",
    "ms/batch",
    "tokens/s",
  )
  print("| " + " | ".join(header) + " |")
  print("|" + "|".join("---" for _ in header) + "|")
  for tok, name, n, load_s, setup_s, ms, tps in rows:
    print(f"| {tok} | {name} | {n:,} | {load_s:.2f} | {setup_s:.3f} | {ms:.3f} | {tps:,.0f} |")


if __name__ == "__main__":
  main()
