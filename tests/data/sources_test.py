"""Tests of the corpus sources (pystdlib, files, hub), the token cache and their errors."""

import dataclasses
import json
import logging
import pathlib
import re
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roformer import data, testing
from roformer.data.sources import local_files, pystdlib
from roformer.data.tokenizer import ByteTokenizer

FIXTURES = testing.FIXTURES / "data"
DOCS = str(FIXTURES / "docs" / "*.txt")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
  # No test may need the network.
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _cfg(tmp_path, **kwargs):
  return data.DataConfig(cache_dir=str(tmp_path / "cache"), **kwargs)


def _bytes_docs(tokens):
  """Splits a token array at EOS into the decoded documents."""
  tok = ByteTokenizer()
  ends = np.flatnonzero(np.asarray(tokens) == tok.eos_id)
  starts = np.concatenate([[0], ends[:-1] + 1])
  return [tok.decode(tokens[s:e]) for s, e in zip(starts, ends, strict=True)]


# ---- pystdlib ----


def test_pystdlib_loads_offline_and_logs_split_sizes_and_hash(tmp_path, caplog):
  caplog.set_level(logging.INFO, logger="roformer.data")
  corpus = data.load_corpus(_cfg(tmp_path), workdir=str(tmp_path / "run"))
  log_text = caplog.text
  match = re.search(
    r"train (\d+) files (\d+) bytes; validation (\d+) files (\d+) bytes; test (\d+) files (\d+) "
    r"bytes; content sha256 ([0-9a-f]{64})",
    log_text,
  )
  assert match, log_text
  train_files, train_bytes, val_files, _, test_files, _, _ = match.groups()
  num_files = int(train_files) + int(val_files) + int(test_files)
  assert 0.85 < int(train_files) / num_files < 0.95
  assert int(val_files) >= 1 and int(test_files) >= 1
  assert int(train_bytes) > 5_000_000  # the standard library is ~11 MB of code
  train = corpus.tokens("train")
  assert train.dtype == np.int32 and train[-1] == corpus.tokenizer.eos_id
  assert len(train) > int(train_bytes) * 0.99  # bytes tokenizer: one token per byte (+ EOS)
  assert len(corpus.tokens("test")) > 0


def test_pystdlib_split_is_a_function_of_the_path_and_excludes_tests():
  files = pystdlib.stdlib_files(pystdlib.sysconfig.get_paths()["stdlib"])
  assert files == sorted(files)
  parts = {part for f in files for part in f.split("/")[:-1]}
  assert not parts & {"test", "tests", "idlelib", "site-packages"}
  assert [pystdlib.split_of(f) for f in files] == [pystdlib.split_of(f) for f in files]
  assert pystdlib.split_of("json/decoder.py") == pystdlib.split_of("json/decoder.py")
  assert {pystdlib.split_of(f) for f in files} == {"train", "validation", "test"}


# ---- files ----


def test_files_txt_are_documents_and_last_document_is_validation(tmp_path):
  corpus = data.load_corpus(_cfg(tmp_path, source="files", files=DOCS), workdir="")
  train = _bytes_docs(corpus.tokens("train"))
  validation = _bytes_docs(corpus.tokens("validation"))
  paths = sorted((FIXTURES / "docs").glob("*.txt"))
  assert train + validation == [p.read_text(encoding="utf-8") for p in paths]
  assert len(validation) == 1  # 4 documents * 0.05 -> at least one


def test_files_single_document_is_cut_at_a_line_for_validation(tmp_path):
  path = tmp_path / "one.txt"
  path.write_text("".join(f"line {i}\n" for i in range(100)))
  cfg = _cfg(tmp_path, source="files", files=str(path), validation_fraction=0.1)
  corpus = data.load_corpus(cfg, workdir="")
  train, validation = _bytes_docs(corpus.tokens("train")), _bytes_docs(corpus.tokens("validation"))
  assert train[0] + validation[0] == path.read_text()
  # The cut moves back to the start of the line: at least 10% of the text, at most a line more.
  assert validation[0].startswith("line 90\n")


def test_files_jsonl_parquet_and_validation_files_are_read(tmp_path):
  records = [json.loads(line) for line in (FIXTURES / "records.jsonl").read_text().splitlines()]
  pq.write_table(pa.table({"text": ["parquet 1", "parquet 2"]}), tmp_path / "p.parquet")
  cfg = _cfg(
    tmp_path,
    source="files",
    files=str(FIXTURES / "records.jsonl"),
    validation_files=str(tmp_path / "p.parquet"),
  )
  corpus = data.load_corpus(cfg, workdir="")
  assert _bytes_docs(corpus.tokens("train")) == [r["text"] for r in records]
  assert _bytes_docs(corpus.tokens("validation")) == ["parquet 1", "parquet 2"]


def test_files_text_field_selects_the_column(tmp_path):
  pq.write_table(pa.table({"id": [1, 2], "body": ["body 1", "body 2"]}), tmp_path / "p.parquet")
  cfg = _cfg(tmp_path, source="files", files=str(tmp_path / "p.parquet"), text_field="body")
  corpus = data.load_corpus(cfg, workdir="")
  assert _bytes_docs(corpus.tokens("train")) == ["body 1"]
  assert _bytes_docs(corpus.tokens("validation")) == ["body 2"]
  with pytest.raises(data.DataError, match="data.text_field='text'.*p.parquet"):
    data.load_corpus(dataclasses.replace(cfg, text_field="text"), workdir="")


def test_files_test_split_absent_raises_and_test_files_provide_it(tmp_path):
  corpus = data.load_corpus(_cfg(tmp_path, source="files", files=DOCS), workdir="")
  with pytest.raises(data.DataError, match="no test split.*data.test_files"):
    corpus.tokens("test")
  cfg = _cfg(tmp_path, source="files", files=DOCS, test_files=str(FIXTURES / "records.jsonl"))
  corpus = data.load_corpus(cfg, workdir="")
  assert len(_bytes_docs(corpus.tokens("test"))) == 12


# ---- cache ----


def test_corpus_second_load_does_not_tokenize(tmp_path, monkeypatch):
  calls = []
  encode_batch = ByteTokenizer.encode_batch
  monkeypatch.setattr(
    ByteTokenizer, "encode_batch", lambda self, texts: calls.append(1) or encode_batch(self, texts)
  )
  cfg = _cfg(tmp_path)
  first = data.load_corpus(cfg, workdir="")
  assert calls
  calls.clear()
  second = data.load_corpus(cfg, workdir="")
  for split in ("train", "validation"):
    np.testing.assert_array_equal(first.tokens(split), second.tokens(split))
  assert not calls


def test_corpus_cache_is_invalidated_when_a_file_changes(tmp_path):
  path = tmp_path / "doc.txt"
  path.write_text("first version\n" * 20)
  cfg = _cfg(tmp_path, source="files", files=str(path))
  before = data.load_corpus(cfg, workdir="").tokens("train")
  path.write_text("second version, longer\n" * 20)
  after = data.load_corpus(cfg, workdir="").tokens("train")
  assert ByteTokenizer().decode(after).startswith("second version")
  assert len(after) != len(before)


# ---- errors ----


def _bad_inputs(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "a.txt").write_text("")
  (tmp_path / "empty" / "b.txt").write_text("")
  missing = str(tmp_path / "nothing" / "*.txt")
  no_field = str(FIXTURES / "no_text_field.jsonl")
  return {
    "glob_matches_nothing": (dict(source="files", files=missing), re.escape(missing)),
    "no_glob": (dict(source="files"), "data.files"),
    "empty_corpus": (
      dict(source="files", files=str(tmp_path / "empty" / "*.txt")),
      "data.files=.*empty",
    ),
    "jsonl_without_text_field": (
      dict(source="files", files=no_field),
      "data.text_field='text'.*no_text_field.jsonl",
    ),
    "unknown_source": (dict(source="web"), "data.source='web'.*pystdlib, files, hub"),
    "unknown_tokenizer": (
      dict(tokenizer="sentencepiece"),
      "data.tokenizer=.*bytes, bpe, wordpiece",
    ),
    "missing_tokenizer_json": (dict(tokenizer=str(tmp_path / "t.json")), re.escape("t.json")),
    "hub_offline": (
      dict(source="hub", hub_name="wikitext", hub_config="wikitext-2-raw-v1"),
      "data.hub_name='wikitext'.*cannot be reached.*data.source=files",
    ),
    "bad_validation_fraction": (
      dict(source="files", files=DOCS, validation_fraction=0.0),
      "data.validation_fraction=0.0",
    ),
  }


@pytest.mark.parametrize(
  "case",
  [
    "glob_matches_nothing",
    "no_glob",
    "empty_corpus",
    "jsonl_without_text_field",
    "unknown_source",
    "unknown_tokenizer",
    "missing_tokenizer_json",
    "hub_offline",
    "bad_validation_fraction",
  ],
)
def test_load_corpus_bad_input_raises_data_error_naming_field(tmp_path, case):
  overrides, pattern = _bad_inputs(tmp_path)[case]
  with pytest.raises(data.DataError, match=pattern):
    data.load_corpus(_cfg(tmp_path, **overrides), workdir=str(tmp_path / "run"))


@pytest.mark.parametrize("suffix", ["", "/"])
def test_files_glob_naming_a_directory_says_so_and_suggests_its_files(tmp_path, suffix):
  (tmp_path / "text").mkdir()
  (tmp_path / "text" / "a.txt").write_text("x\n")
  folder = str(tmp_path / "text")
  with pytest.raises(data.DataError) as raised:
    local_files.expand(folder + suffix, field="data.files")
  assert str(raised.value) == (
    f"data.files={folder + suffix!r}: {folder} is a directory; give a glob of its files, e.g. "
    f"{folder}/*.txt (or {folder}/**/*.txt with subdirectories)"
  )


def _latin1_corpus(tmp_path, ext: str) -> pathlib.Path:
  """One good UTF-8 file and one Latin-1 file whose first non-ASCII byte is at offset 9."""
  folder = tmp_path / "text"
  folder.mkdir()
  if ext == ".txt":
    (folder / "a_good.txt").write_text("caf\u00e9 ok\n" * 20, encoding="utf-8")
    (folder / "b_latin1.txt").write_bytes("plain\ncaf\u00e9 au lait\n".encode("latin-1") * 20)
  else:
    good = json.dumps({"text": "fine"}) + "\n"
    (folder / "a_good.jsonl").write_text(good * 20, encoding="utf-8")
    bad = good * 3000 + json.dumps({"text": "caf\u00e9"}, ensure_ascii=False) + "\n"
    (folder / "b_latin1.jsonl").write_bytes(bad.encode("latin-1"))
  return folder


@pytest.mark.parametrize("ext, offset", [(".txt", 9), (".jsonl", 3000 * 17 + 13)])
def test_files_undecodable_text_names_file_offset_and_text_encoding(tmp_path, ext, offset):
  folder = _latin1_corpus(tmp_path, ext)
  cfg = _cfg(tmp_path, source="files", files=str(folder / f"*{ext}"))
  with pytest.raises(data.DataError) as error:
    data.load_corpus(cfg, workdir="").tokens("train")
  message = str(error.value)
  assert f"b_latin1{ext} is not utf-8 text (byte 0xe9 at offset {offset})" in message
  assert "data.text_encoding" in message and "a_good" not in message


def test_files_text_encoding_decodes_latin1(tmp_path):
  folder = _latin1_corpus(tmp_path, ".txt")
  cfg = _cfg(
    tmp_path,
    source="files",
    files=str(folder / "b_latin1.txt"),
    validation_files=str(folder / "b_latin1.txt"),
    text_encoding="latin-1",
  )
  tokens = data.load_corpus(cfg, workdir="", splits=("train",)).tokens("train")
  (document,) = _bytes_docs(np.asarray(tokens))
  assert document == "plain\ncaf\u00e9 au lait\n" * 20


def test_first_undecodable_byte_is_exact_across_read_chunks(tmp_path):
  path = tmp_path / "big.txt"
  head = "\u00e9".encode() * ((1 << 20) // 2) + b"x"  # a two-byte character cut by the chunk end
  path.write_bytes(head + "\u00e9".encode() + b"\xff")
  assert local_files.first_undecodable_byte(str(path), "utf-8") == len(head) + 2
  assert local_files.first_undecodable_byte(str(path), "latin-1") is None


def test_hub_unreachable_endpoint_fails_fast(tmp_path, monkeypatch):
  monkeypatch.delenv("HF_DATASETS_OFFLINE")
  monkeypatch.delenv("HF_HUB_OFFLINE")
  monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
  cfg = _cfg(tmp_path, source="hub", hub_name="wikitext", streaming=True)
  start = time.perf_counter()
  with pytest.raises(data.DataError, match="cannot be reached.*data.source=files"):
    data.load_corpus(cfg, workdir="")
  assert time.perf_counter() - start < 10


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_local_dataset_directory_loads_splits_and_bounds_streaming(tmp_path, streaming):
  torch_was_imported = "torch" in sys.modules
  hub_dir = tmp_path / "dataset"
  hub_dir.mkdir()
  for split, n in (("train", 10), ("validation", 3)):
    lines = [json.dumps({"body": f"{split} {i}"}) for i in range(n)]
    (hub_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
  cfg = _cfg(
    tmp_path,
    source="hub",
    hub_name=str(hub_dir),
    text_field="body",
    hub_test_split="",
    streaming=streaming,
    hub_max_documents=4,
  )
  corpus = data.load_corpus(cfg, workdir="")
  expected = [f"train {i}" for i in range(4 if streaming else 10)]
  assert _bytes_docs(corpus.tokens("train")) == expected
  assert _bytes_docs(corpus.tokens("validation")) == [f"validation {i}" for i in range(3)]
  with pytest.raises(data.DataError, match="no test split: data.hub_test_split"):
    corpus.tokens("test")
  held_out = data.load_corpus(dataclasses.replace(cfg, hub_validation_split=""), workdir="")
  assert _bytes_docs(held_out.tokens("validation")) == expected[-1:]
  assert torch_was_imported or "torch" not in sys.modules  # the project never imports torch
