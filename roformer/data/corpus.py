"""A tokenized corpus: every split is one int32 array of documents, each followed by EOS.

Token arrays are cached under data.cache_dir keyed by (source identity, tokenizer fingerprint,
split), so a rerun, another process or eval.py loads them without tokenizing again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from roformer.data.batches import TrainBatches
from roformer.data.cache import TokenCache, cache_key
from roformer.data.config import DataConfig
from roformer.data.sources import Source, cache_root, make_source
from roformer.data.tokenizer import Tokenizer, build_tokenizer
from roformer.errors import DataError

if TYPE_CHECKING:  # imported where documents are read (sources/base.py)
  import datasets

log = logging.getLogger(__name__)

_BATCH_DOCUMENTS = 256  # documents per tokenizer call; encode_batch parallelises within a call


class Corpus:
  """Token arrays of the splits of one source under one tokenizer.

  Attributes:
    tokenizer: the Tokenizer used for every split.
    source: the Source the documents come from.
  """

  def __init__(self, *, source: Source, tokenizer: Tokenizer, cache: TokenCache):
    self.source = source
    self.tokenizer = tokenizer
    self._cache = cache
    self._tokens: dict[str, np.ndarray] = {}

  def train_batches(self, cfg: DataConfig, **kwargs):
    """The training batches of this corpus: `TrainBatches(self, cfg, **kwargs)`."""
    return TrainBatches(self, cfg, **kwargs)

  def tokens(self, split: str) -> np.ndarray:
    """int32 [N]: the documents of `split` ("train", "validation", "test") each followed by EOS.

    Raises:
      DataError: the source has no such split, or it holds no text.
    """
    if split not in self._tokens:
      self._tokens[split] = self._load(split)
    return self._tokens[split]

  def _load(self, split: str) -> np.ndarray:
    identity = self.source.identity()  # FilesSource stats every file: compute it once
    key = cache_key(source=identity, tokenizer=self.tokenizer.fingerprint, split=split)
    cached = self._cache.load(key)
    if cached is not None:
      tokens, meta = cached
      log.info(
        "%s %s: %d documents, %d tokens (cached in %s).",
        self.source.describe(),
        split,
        meta["num_documents"],
        len(tokens),
        self._cache.path(key),
      )
      return tokens
    start = time.perf_counter()
    tokens, num_documents = tokenize_documents(self.source.documents(split), self.tokenizer)
    if num_documents == 0:
      raise DataError(f"{self.source.describe()}: the {split} split has no text (empty corpus)")
    self._cache.save(
      key,
      tokens,
      {
        "source": identity,
        "tokenizer": self.tokenizer.fingerprint,
        "split": split,
        "num_documents": num_documents,
      },
    )
    log.info(
      "%s %s: %d documents, %d tokens (tokenized in %.1f s, cached in %s).",
      self.source.describe(),
      split,
      num_documents,
      len(tokens),
      time.perf_counter() - start,
      self._cache.path(key),
    )
    return np.load(self._cache.path(key), mmap_mode="r")


def tokenize_documents(ds: datasets.Dataset, tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
  """Tokenizes the non-empty "text" rows of `ds` and joins them, each followed by EOS.

  Returns:
    (tokens int32 [N], number of documents).
  """
  eos = np.asarray([tokenizer.eos_id], dtype=np.int32)
  pieces = []
  for batch in ds.iter(batch_size=_BATCH_DOCUMENTS):
    texts = [t for t in batch["text"] if t]
    for ids in tokenizer.encode_batch(texts):
      pieces.extend((ids, eos))
  num_documents = len(pieces) // 2
  tokens = np.concatenate(pieces) if pieces else np.zeros([0], np.int32)
  return tokens.astype(np.int32, copy=False), num_documents


def load_corpus(
  cfg: DataConfig, *, workdir: str, splits: Sequence[str] = ("train", "validation")
) -> Corpus:
  """Builds the tokenizer and tokenizes (or loads from the cache) `splits` of `cfg.source`.

  Args:
    cfg: the data config.
    workdir: run directory; a trained tokenizer is saved to and reused from WORKDIR/tokenizer.json.
    splits: splits prepared now, so bad data fails here; others load on first `tokens(split)`.

  Returns:
    The Corpus.

  Raises:
    DataError: a bad source, field, path or tokenizer; the message names it.
  """
  if cfg.source == "synthetic":  # generated on the fly: no documents, tokenizer or cache
    from roformer.data.synthetic import SyntheticCorpus

    return SyntheticCorpus(cfg)
  source = make_source(cfg)
  tokenizer = build_tokenizer(cfg, workdir=workdir, source=source)
  corpus = Corpus(source=source, tokenizer=tokenizer, cache=TokenCache(cache_root(cfg)))
  for split in splits:
    corpus.tokens(split)
  return corpus
