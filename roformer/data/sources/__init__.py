"""Corpus sources: the interface (base.py), the sources, and the factory.

A source yields documents as a `datasets.Dataset` with one string column "text" per split
("train", "validation", "test"), and an identity that changes whenever its text may change.
"""

from __future__ import annotations

import os

from roformer.data.config import SOURCES, DataConfig
from roformer.data.sources import hub, local_files, pystdlib
from roformer.data.sources.base import SPLITS, Source, cache_root, hold_out, num_chars
from roformer.errors import DataError


def make_source(cfg: DataConfig) -> Source:
  """The source of `cfg.source`; cheap checks (globs, fields) run here, loading is lazy."""
  cache_dir = os.path.join(cache_root(cfg), "datasets")
  if cfg.source == "pystdlib":
    return pystdlib.PyStdlibSource(cache_dir=cache_dir)
  if cfg.source == "files":
    return local_files.FilesSource(cfg, cache_dir=cache_dir)
  if cfg.source == "hub":
    return hub.HubSource(cfg, cache_dir=cache_dir)
  raise DataError(f"data.source={cfg.source!r} is not one of {', '.join(SOURCES)}")


__all__ = ["SPLITS", "Source", "cache_root", "hold_out", "make_source", "num_chars"]
