"""The source interface and what every source shares: splits, the cache root, the held-out
validation split.

A source yields documents as a `datasets.Dataset` with one string column "text" per split
("train", "validation", "test"), and an identity that changes whenever its text may change.
"""

from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc

from roformer.data.config import DataConfig
from roformer.errors import DataError

if TYPE_CHECKING:
  # Every source imports `datasets` where it reads documents, not at the top: the import takes
  # about a second (pandas, pyarrow's datasets), which a run whose tokens are cached, eval.py
  # and generate.py would pay at every start for nothing.
  import datasets

SPLITS = ("train", "validation", "test")


class Source(abc.ABC):
  """Documents of one corpus, split into train / validation / test."""

  @abc.abstractmethod
  def identity(self) -> dict[str, Any]:
    """JSON-serialisable description that changes when the text may change (cheap to compute)."""

  @abc.abstractmethod
  def describe(self) -> str:
    """The config field(s) naming this corpus, for messages (e.g. "data.files='a/*.txt'")."""

  @abc.abstractmethod
  def _load(self, split: str) -> datasets.Dataset:
    """The documents of `split` (a column "text"), or DataError if the source has no such split."""

  def documents(self, split: str) -> datasets.Dataset:
    """Documents of `split` as a Dataset with a string column "text"; DataError if empty."""
    if split not in SPLITS:
      raise DataError(f"split={split!r} is not one of {', '.join(SPLITS)}")
    ds = self._load(split)
    if num_chars(ds) == 0:
      raise DataError(f"{self.describe()}: the {split} split has no text (empty corpus)")
    return ds


def cache_root(cfg: DataConfig | None = None) -> str:
  """data.cache_dir, else $ROFORMER_CACHE, else ~/.cache/roformer."""
  root = (cfg.cache_dir if cfg else "") or os.environ.get("ROFORMER_CACHE") or "~/.cache/roformer"
  return os.path.abspath(os.path.expanduser(root))


def num_chars(ds: datasets.Dataset) -> int:
  """Total characters of the "text" column (nulls count as empty)."""
  if len(ds) == 0:
    return 0
  return int(pc.sum(pc.utf8_length(ds.data.column("text"))).as_py() or 0)


def hold_out(ds: datasets.Dataset, *, fraction: float, split: str) -> datasets.Dataset:
  """The train or validation part of `ds`: validation is the last `fraction` of the documents.

  At least one document is held out. A corpus of a single document (e.g. one .txt file) is cut
  instead at the line boundary nearest before the last `fraction` of its characters.
  """
  import datasets

  if not 0.0 < fraction < 1.0:
    raise DataError(f"data.validation_fraction={fraction} must be in (0, 1) to hold out validation")
  n = len(ds)
  if n >= 2:
    n_val = max(1, int(n * fraction))
    rows = range(n - n_val) if split == "train" else range(n - n_val, n)
    return ds.select(rows)
  text = ds[0]["text"] if n else ""
  cut = len(text) - max(1, int(len(text) * fraction))
  line_start = text.rfind("\n", 0, cut) + 1
  if line_start > 0:
    cut = line_start
  part = text[:cut] if split == "train" else text[cut:]
  return datasets.Dataset.from_dict({"text": [part]})
