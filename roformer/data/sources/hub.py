"""The `hub` source: any Hugging Face dataset by name, optionally streamed.

Reaching the Hub is checked first with a short timeout, so an offline machine fails at once with
a DataError that suggests data.source=files instead of retrying for minutes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

import huggingface_hub

from roformer.data.config import DataConfig
from roformer.data.sources import base
from roformer.errors import DataError

if TYPE_CHECKING:  # imported where documents are read (base.py)
  import datasets

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
_TRUE = ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
  """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE asks for offline mode."""
  env = any(
    os.environ.get(v, "").strip().upper() in _TRUE
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
  )
  return env or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def check_hub_reachable(name: str) -> None:
  """DataError unless the Hub answers within CONNECT_TIMEOUT_S (any HTTP status will do)."""
  hint = "; use data.source=files with local files (data.files=GLOB) instead"
  if hub_offline():
    raise DataError(
      f"data.hub_name={name!r}: the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE or "
      f"HF_DATASETS_OFFLINE is set){hint}"
    )
  endpoint = (os.environ.get("HF_ENDPOINT") or huggingface_hub.constants.ENDPOINT).rstrip("/")
  request = urllib.request.Request(f"{endpoint}/api/datasets/{name}", method="HEAD")
  try:
    urllib.request.urlopen(request, timeout=CONNECT_TIMEOUT_S).close()
  except urllib.error.HTTPError:
    pass  # the server answered; load_dataset reports a missing or private dataset precisely
  except (urllib.error.URLError, OSError) as e:
    raise DataError(
      f"data.hub_name={name!r}: the Hugging Face Hub at {endpoint} cannot be reached ({e}){hint}"
    ) from e


@contextlib.contextmanager
def _without_torch():
  """Stops `datasets` from importing torch (6 s, unused here) for streaming datasets."""
  import datasets

  saved = datasets.config.TORCH_AVAILABLE
  datasets.config.TORCH_AVAILABLE = False
  try:
    yield
  finally:
    datasets.config.TORCH_AVAILABLE = saved


class HubSource(base.Source):
  """A Hub dataset; splits come from data.hub_{train,validation,test}_split."""

  def __init__(self, cfg: DataConfig, *, cache_dir: str):
    if not cfg.hub_name:
      raise DataError("data.source='hub' needs data.hub_name, a Hugging Face dataset name")
    if cfg.streaming and cfg.hub_max_documents <= 0:
      raise DataError(f"data.hub_max_documents={cfg.hub_max_documents} must be > 0 when streaming")
    self._cfg = cfg
    self._cache_dir = cache_dir
    self._checked = False

  def identity(self):
    cfg = self._cfg
    return {
      "source": "hub",
      "name": cfg.hub_name,
      "config": cfg.hub_config,
      "splits": [cfg.hub_train_split, cfg.hub_validation_split, cfg.hub_test_split],
      "validation_fraction": None if cfg.hub_validation_split else cfg.validation_fraction,
      "streaming": cfg.streaming,
      "max_documents": cfg.hub_max_documents if cfg.streaming else None,
      "text_field": cfg.text_field,
    }

  def describe(self) -> str:
    config = f", data.hub_config={self._cfg.hub_config!r}" if self._cfg.hub_config else ""
    return f"data.hub_name={self._cfg.hub_name!r}{config}"

  def _load(self, split: str) -> datasets.Dataset:
    cfg = self._cfg
    if split == "test":
      if not cfg.hub_test_split:
        raise DataError(f"{self.describe()} has no test split: data.hub_test_split is empty")
      return self._fetch(cfg.hub_test_split, field="data.hub_test_split")
    if split == "validation" and cfg.hub_validation_split:
      return self._fetch(cfg.hub_validation_split, field="data.hub_validation_split")
    ds = self._fetch(cfg.hub_train_split, field="data.hub_train_split")
    if cfg.hub_validation_split:
      return ds
    return base.hold_out(ds, fraction=cfg.validation_fraction, split=split)

  def _fetch(self, hub_split: str, *, field: str) -> datasets.Dataset:
    cfg = self._cfg
    if not os.path.isdir(cfg.hub_name) and not self._checked:
      check_hub_reachable(cfg.hub_name)
      self._checked = True
    with _without_torch():
      return self._fetch_split(hub_split, field=field)

  def _fetch_split(self, hub_split: str, *, field: str) -> datasets.Dataset:
    import datasets

    cfg = self._cfg
    try:
      ds = datasets.load_dataset(
        cfg.hub_name,
        cfg.hub_config or None,
        split=hub_split,
        streaming=cfg.streaming,
        cache_dir=self._cache_dir,
        download_config=datasets.DownloadConfig(max_retries=1),
      )
    except Exception as e:  # DatasetNotFoundError, unknown split/config, HTTP errors, ...
      raise DataError(
        f"{self.describe()}, {field}={hub_split!r}: the dataset could not be loaded: {e}"
      ) from e
    columns = ds.column_names or []
    if cfg.text_field not in columns:
      raise DataError(
        f"data.text_field={cfg.text_field!r} is not a column of {self.describe()} ({columns})"
      )
    if cfg.streaming:
      rows = itertools.islice(ds, cfg.hub_max_documents)
      texts = [row[cfg.text_field] or "" for row in rows]
      log.info("Streamed %d documents of %s split %r.", len(texts), self.describe(), hub_split)
      return datasets.Dataset.from_dict({"text": texts})
    ds = ds.select_columns([cfg.text_field])
    return ds if cfg.text_field == "text" else ds.rename_column(cfg.text_field, "text")
