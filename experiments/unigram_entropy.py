"""Prints the unigram entropy (nats per token) of a corpus split: the loss of a model that ignores
context, the yardstick the quickstart's validation loss is compared with.

Usage: python -m experiments.unigram_entropy [--source=pystdlib] [--split=validation]
"""

import argparse
import tempfile

import numpy as np

from roformer.data import DataConfig, load_corpus


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy in nats of the empirical token distribution."""
  counts = np.bincount(tokens)
  p = counts[counts > 0] / len(tokens)
  return float(-(p * np.log(p)).sum())


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--source", default="pystdlib")
  parser.add_argument("--files", default="")
  parser.add_argument("--tokenizer", default="bytes")
  parser.add_argument("--split", default="validation")
  args = parser.parse_args()
  cfg = DataConfig(source=args.source, files=args.files, tokenizer=args.tokenizer)
  with tempfile.TemporaryDirectory() as workdir:
    corpus = load_corpus(cfg, workdir=workdir, splits=(args.split,))
    tokens = np.asarray(corpus.tokens(args.split))
  text = tokens[~np.isin(tokens, corpus.tokenizer.special_ids)]  # the text itself, without EOS
  print(f"{args.source} {args.split}: {len(text):,} tokens of text")
  print(f"unigram entropy: {unigram_entropy(text):.4f} nats/token")
  print(f"half of it:      {unigram_entropy(text) / 2:.4f} nats/token")


if __name__ == "__main__":
  main()
