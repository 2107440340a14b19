"""The `files` source: local .txt (one file = one document), .jsonl/.json and .parquet files.

Files are read with the `datasets` "text" / "json" / "parquet" builders. Validation comes from
data.validation_files, else the last data.validation_fraction of the documents; the test split
exists only when data.test_files is set.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import os
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from roformer.data.config import DataConfig
from roformer.data.sources import base
from roformer.errors import DataError

if TYPE_CHECKING:  # imported where documents are read (base.py)
  import datasets

log = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# The advice of an undecodable file that a tool without a data.text_encoding flag leaves out.
TEXT_ENCODING_ADVICE = "set data.text_encoding to the file's encoding (e.g. latin-1), or "


def expand(patterns: str, *, field: str) -> list[str]:
  """Sorted absolute paths matched by comma-separated globs; DataError naming `field` if none."""
  paths = set()
  for pattern in (p.strip() for p in patterns.split(",")):
    if pattern:
      paths.update(glob.glob(os.path.expanduser(pattern), recursive=True))
  files = sorted(os.path.abspath(p) for p in paths if os.path.isfile(p))
  if not files:
    folders = sorted(p for p in paths if os.path.isdir(p))
    if folders:  # a directory matches itself, not the files in it
      folder = folders[0].rstrip("/")
      raise DataError(
        f"{field}={patterns!r}: {folder} is a directory; give a glob of its files, e.g. "
        f"{folder}/*.txt (or {folder}/**/*.txt with subdirectories)"
      )
    raise DataError(f"{field}={patterns!r}: the glob matches no files")
  for path in files:
    if os.path.splitext(path)[1].lower() not in BUILDERS:
      raise DataError(
        f"{field}={patterns!r}: {path!r} is not one of the supported types {', '.join(BUILDERS)}"
      )
  return files


class FilesSource(base.Source):
  """Documents from local files matched by data.files (and data.validation_files/test_files)."""

  def __init__(self, cfg: DataConfig, *, cache_dir: str):
    if not cfg.files:
      raise DataError("data.source='files' needs data.files, a glob of .txt/.jsonl/.parquet files")
    self._cfg = cfg
    self._cache_dir = cache_dir
    self._globs = {"train": ("data.files", cfg.files)}
    if cfg.validation_files:
      self._globs["validation"] = ("data.validation_files", cfg.validation_files)
    if cfg.test_files:
      self._globs["test"] = ("data.test_files", cfg.test_files)
    self._files = {split: expand(g, field=f) for split, (f, g) in self._globs.items()}
    for split, paths in self._files.items():
      for path in paths:
        _check_text_field(path, cfg, field=self._globs[split][0])

  def identity(self):
    stats = {
      split: [(p, st.st_size, st.st_mtime_ns) for p in paths for st in [os.stat(p)]]
      for split, paths in self._files.items()
    }
    return {
      "source": "files",
      "files": stats,
      "text_field": self._cfg.text_field,
      "text_encoding": self._cfg.text_encoding,
      "validation_fraction": None if "validation" in self._files else self._cfg.validation_fraction,
    }

  def describe(self) -> str:
    return ", ".join(self._where(split) for split in self._globs)

  def _load(self, split: str) -> datasets.Dataset:
    if split in ("train", "validation") and "validation" not in self._files:
      ds = self._read(self._files["train"], where=self._where("train"))
      return base.hold_out(ds, fraction=self._cfg.validation_fraction, split=split)
    if split in self._files:
      return self._read(self._files[split], where=self._where(split))
    raise DataError(
      "data.source='files' has no test split: set data.test_files to a glob of test files "
      "(or evaluate on the validation split)"
    )

  def _where(self, split: str) -> str:
    field, pattern = self._globs[split]
    return f"{field}={pattern!r}"

  def _read(self, paths: list[str], *, where: str) -> datasets.Dataset:
    import datasets

    paths = [p for p in paths if os.path.getsize(p) > 0]
    if not paths:
      raise DataError(f"{where}: every matched file is empty (empty corpus)")
    by_builder: dict[str, list[str]] = {}
    for path in paths:
      by_builder.setdefault(BUILDERS[os.path.splitext(path)[1].lower()], []).append(path)
    parts = []
    text_field = self._cfg.text_field
    for builder, files in by_builder.items():
      kwargs = {"sample_by": "document"} if builder == "text" else {}
      if builder != "parquet":
        kwargs["encoding"] = self._cfg.text_encoding
        # Checked first: the JSON reader keeps invalid UTF-8 and fails later, naming no file.
        for path in files:
          _check_decodable(path, self._cfg.text_encoding, where=where)
      try:
        ds = datasets.load_dataset(
          builder, data_files=files, split="train", cache_dir=self._cache_dir, **kwargs
        )
      except Exception as e:  # datasets raises many types (cast errors, JSON errors, ...)
        raise DataError(f"{where}: could not read {builder} files {files}: {e}") from e
      column = "text" if builder == "text" else text_field
      if column not in ds.column_names:
        raise DataError(f"data.text_field={text_field!r} is not a column of {files} ({where})")
      if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
        raise DataError(
          f"data.text_field={text_field!r} holds {ds.features[column]}, not text, in {files}"
        )
      ds = ds.select_columns([column])
      if column != "text":
        ds = ds.rename_column(column, "text")
      parts.append(ds)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def first_undecodable_byte(path: str, encoding: str) -> int | None:
  """Offset of the first byte of `path` that is not valid `encoding` text, or None."""
  decoder = codecs.getincrementaldecoder(encoding)()
  offset = 0  # bytes read so far
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      pending = len(decoder.getstate()[0])  # bytes of a character cut by the last chunk
      try:
        decoder.decode(chunk)
      except UnicodeDecodeError as e:
        return offset - pending + e.start
      offset += len(chunk)
    pending = len(decoder.getstate()[0])
    try:
      decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
      return offset - pending + e.start
  return None


def _check_decodable(path: str, encoding: str, *, where: str) -> None:
  """DataError naming the file, the byte offset and data.text_encoding if `path` is not text."""
  offset = first_undecodable_byte(path, encoding)
  if offset is None:
    return
  with open(path, "rb") as f:
    f.seek(offset)
    byte = f.read(1)[0]
  raise DataError(
    f"{where}: {path} is not {encoding} text (byte 0x{byte:02x} at offset {offset}); "
    f"{TEXT_ENCODING_ADVICE}convert the file to {encoding}"
  )


def _check_text_field(path: str, cfg: DataConfig, *, field: str) -> None:
  """DataError naming data.text_field and `path` if its first record has no such column."""
  ext = os.path.splitext(path)[1].lower()
  text_field = cfg.text_field
  if ext in (".jsonl", ".json"):
    try:
      with open(path, encoding=cfg.text_encoding) as f:
        first = next((line for line in f if line.strip()), "")
    except UnicodeDecodeError:
      _check_decodable(path, cfg.text_encoding, where=field)
      raise
    if not first:
      return  # an empty file adds no documents
    try:
      record = json.loads(first)
    except json.JSONDecodeError:
      # A .json file may hold one pretty-printed object or array; let the builder judge it.
      if ext == ".jsonl":
        raise DataError(f"{field}: {path!r} line 1 is not JSON") from None
      return
    if isinstance(record, dict) and text_field not in record:
      raise DataError(
        f"data.text_field={text_field!r} is missing from {path!r} (first record has "
        f"{sorted(record)})"
      )
  elif ext == ".parquet":
    try:
      names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError
      raise DataError(f"{field}: {path!r} is not a Parquet file ({e})") from e
    if text_field not in names:
      raise DataError(f"data.text_field={text_field!r} is not a column of {path!r} ({names})")
