"""On-disk cache of tokenized splits: one int32 .npy (memory-mapped on load) + a .json per key."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import numpy as np

FORMAT_VERSION = 1


def cache_key(**identity: Any) -> str:
  """A hex digest of a JSON-serialisable identity (source, tokenizer, split, ...)."""
  blob = json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


class TokenCache:
  """Token arrays under ROOT/tokens/KEY.npy with metadata in ROOT/tokens/KEY.json."""

  def __init__(self, root: str):
    self.dir = os.path.join(root, "tokens")

  def path(self, key: str) -> str:
    return os.path.join(self.dir, f"{key}.npy")

  def load(self, key: str) -> tuple[np.ndarray, dict[str, Any]] | None:
    """(tokens int32 [N] memory-mapped, metadata), or None when absent or unreadable."""
    try:
      with open(os.path.join(self.dir, f"{key}.json")) as f:
        meta = json.load(f)
      tokens = np.load(self.path(key), mmap_mode="r")
    except (OSError, ValueError):
      return None
    if tokens.dtype != np.int32 or tokens.ndim != 1 or len(tokens) != meta.get("num_tokens"):
      return None
    return tokens, meta

  def save(self, key: str, tokens: np.ndarray, meta: dict[str, Any]) -> None:
    """Writes atomically (temp file + rename), so concurrent processes never see half a file."""
    os.makedirs(self.dir, exist_ok=True)
    tmp = os.path.join(self.dir, f".{key}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
      np.save(f, np.ascontiguousarray(tokens, dtype=np.int32))
    os.replace(tmp, self.path(key))
    # The .json is written last: its presence marks a complete entry.
    with open(tmp, "w") as f:
      json.dump({**meta, "num_tokens": int(len(tokens))}, f, indent=1, default=str)
    os.replace(tmp, os.path.join(self.dir, f"{key}.json"))
