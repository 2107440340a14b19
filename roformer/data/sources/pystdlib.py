"""The `pystdlib` source: the running interpreter's standard-library .py files (about 11 MB).

Every machine has it, so it needs no download. Test suites, IDLE and installed packages are
excluded; each file goes to train / validation / test (90 / 5 / 5) by a hash of its relative path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
from collections.abc import Iterator
from typing import TYPE_CHECKING

from roformer.data.sources import base
from roformer.errors import DataError

if TYPE_CHECKING:  # imported where documents are read (base.py)
  import datasets

log = logging.getLogger(__name__)

EXCLUDED_DIRS = frozenset(
  {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)
# Percent of files per split, in the order of base.SPLITS.
SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}


def stdlib_files(root: str) -> list[str]:
  """Sorted relative POSIX paths of the .py files under `root`, minus EXCLUDED_DIRS and test_*."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("test_")]
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if name.endswith(".py"):
        found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
  return sorted(found)


def split_of(relpath: str) -> str:
  """The split of a file, a pure function of its relative path."""
  bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 100
  for split, percent in SPLIT_PERCENT.items():
    if bucket < percent:
      return split
    bucket -= percent
  raise AssertionError("SPLIT_PERCENT must sum to 100")


def _read_files(root: str, relpaths: list[str], content_sha256: str) -> Iterator[dict[str, str]]:
  del content_sha256  # only part of the datasets cache key, so that new contents are re-read
  for rel in relpaths:
    with open(os.path.join(root, rel), "rb") as f:
      yield {"text": f.read().decode("utf-8", errors="replace"), "path": rel}


class PyStdlibSource(base.Source):
  """The standard library of the running interpreter; hashes all files (~0.1 s) and logs sizes."""

  def __init__(self, *, cache_dir: str):
    self._cache_dir = cache_dir
    self.root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files(self.root)
    if not files:
      raise DataError(f"data.source='pystdlib': no .py files under {self.root!r}")
    self.splits: dict[str, list[str]] = {s: [] for s in base.SPLITS}
    num_bytes = dict.fromkeys(base.SPLITS, 0)
    digest = hashlib.sha256()
    for rel in files:
      with open(os.path.join(self.root, rel), "rb") as f:
        data = f.read()
      digest.update(f"{rel}\0{len(data)}\0".encode())
      digest.update(data)
      split = split_of(rel)
      self.splits[split].append(rel)
      num_bytes[split] += len(data)
    self.content_sha256 = digest.hexdigest()
    log.info(
      "pystdlib: Python %s at %s: %s; content sha256 %s",
      sys.version.split()[0],
      self.root,
      "; ".join(f"{s} {len(self.splits[s])} files {num_bytes[s]} bytes" for s in base.SPLITS),
      self.content_sha256,
    )

  def identity(self):
    return {"source": "pystdlib", "root": self.root, "sha256": self.content_sha256}

  def describe(self) -> str:
    return f"data.source='pystdlib' ({self.root})"

  def _load(self, split: str) -> datasets.Dataset:
    import datasets

    text = datasets.Value("string")
    return datasets.Dataset.from_generator(
      _read_files,
      features=datasets.Features({"text": text, "path": text}),
      cache_dir=self._cache_dir,
      gen_kwargs={
        "root": self.root,
        "relpaths": self.splits[split],
        "content_sha256": self.content_sha256,
      },
    )
