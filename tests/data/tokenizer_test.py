"""Tests of the tokenizers: bytes, trained BPE / WordPiece, tokenizer.json files, errors."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from roformer import data, testing
from roformer.data import tokenizer as tokenizer_lib
from roformer.data.sources import make_source

FIXTURES = testing.FIXTURES / "data"
TRICKY = [
  "",
  "hello world",
  "  leading and trailing spaces  \n",
  "tabs\tand\r\nwindows newlines\r\n",
  "emoji 😀🚀🧪 and ZWJ 👩‍👩‍👧",
  "中文字符和日本語のテキスト、한국어",
  "accents: café naïve Ångström",
  "special-looking: <|eos|> <|pad|> [MASK] [CLS] </s> <pad>",
  "def f(x):\n    return x ** 2  # comment\n\n\n",
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _random_unicode(rng, n):
  # Any code point except surrogates, which UTF-8 cannot encode.
  chars = []
  while len(chars) < n:
    c = rng.randrange(0x110000)
    if not 0xD800 <= c < 0xE000:
      chars.append(chr(c))
  return "".join(chars)


# ---- bytes ----


def test_bytes_round_trips_any_utf8():
  tok = data.build_tokenizer(data.DataConfig(tokenizer="bytes"), workdir="")
  rng = random.Random(0)
  for text in TRICKY + [_random_unicode(rng, 200) for _ in range(20)]:
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode_batch([text])[0], ids)


def test_bytes_special_ids_are_fixed_and_dropped_by_decode():
  tok = data.ByteTokenizer()
  assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.mask_id, tok.cls_id, tok.sep_id) == (
    261,
    256,
    257,
    258,
    259,
    260,
  )
  np.testing.assert_array_equal(tok.regular_ids, np.arange(256))
  assert tok.decode([104, 105, tok.eos_id, tok.mask_id, 33]) == "hi!"


def test_bytes_saved_json_loads_with_identical_ids(tmp_path):
  path = tmp_path / "bytes.json"
  data.ByteTokenizer().save(path)
  loaded = data.build_tokenizer(data.DataConfig(tokenizer=str(path)), workdir="")
  assert loaded.vocab_size == 261
  assert (loaded.pad_id, loaded.eos_id, loaded.sep_id) == (256, 257, 260)
  for text in TRICKY:
    assert loaded.encode(text) == list(text.encode("utf-8"))
    assert loaded.decode(loaded.encode(text)) == text


# ---- trained tokenizers ----


def test_bpe_trained_on_pystdlib_round_trips_and_reloads_identically(tmp_path, monkeypatch):
  cfg = data.DataConfig(
    tokenizer="bpe", vocab_size=600, tokenizer_max_chars=300_000, cache_dir=str(tmp_path / "c")
  )
  workdir = tmp_path / "run"
  tok = data.build_tokenizer(cfg, workdir=str(workdir))
  assert (workdir / "tokenizer.json").exists()
  assert tok.vocab_size == 600
  assert (tok.pad_id, tok.eos_id, tok.mask_id, tok.cls_id, tok.sep_id) == (0, 1, 2, 3, 4)
  validation = make_source(cfg).documents("validation")["text"][:5]
  texts = TRICKY + list(validation) + [_random_unicode(random.Random(1), 300)]
  encoded = tok.encode_batch(texts)
  for text, ids in zip(texts, encoded, strict=True):
    assert tok.decode(ids) == text
    assert not np.isin(ids, tok.special_ids).any()
  assert sum(len(ids) for ids in encoded[len(TRICKY) : -1]) < 0.6 * sum(map(len, validation))

  # A rerun loads WORKDIR/tokenizer.json instead of training again.
  monkeypatch.setattr(tokenizer_lib, "_train", lambda *a: pytest.fail("trained again"))
  reloaded = data.build_tokenizer(cfg, workdir=str(workdir))
  from_path = data.build_tokenizer(
    data.DataConfig(tokenizer=str(workdir / "tokenizer.json")), workdir=""
  )
  for other in (reloaded, from_path):
    assert other.fingerprint == tok.fingerprint
    for text, ids in zip(texts, encoded, strict=True):
      np.testing.assert_array_equal(other.encode(text), ids)


def test_wordpiece_trains_on_files_and_decodes_words(tmp_path):
  cfg = data.DataConfig(
    source="files",
    files=str(FIXTURES / "records.jsonl"),
    tokenizer="wordpiece",
    vocab_size=120,
    cache_dir=str(tmp_path / "c"),
  )
  tok = data.build_tokenizer(cfg, workdir=str(tmp_path))
  saved = json.loads((tmp_path / "tokenizer.json").read_text())
  assert saved["model"]["type"] == "WordPiece"
  assert tok.decode(tok.encode("rotary attention window.")) == "rotary attention window."
  assert tok.mask_id != tok.pad_id and tok.mask_id in tok.special_ids
  assert tok.backend.token_to_id("[UNK]") in tok.special_ids


def test_wordpiece_training_is_a_function_of_the_text(tmp_path):
  # Two trainings on the same text, here and in a fresh process (another hash seed), write the
  # same file: a rerun of a run trains the tokenizer the run was trained with.
  cfg = data.DataConfig(
    source="files", files=str(FIXTURES / "records.jsonl"), tokenizer="wordpiece", vocab_size=120
  )
  here = {data.build_tokenizer(cfg, workdir="").backend.to_str() for _ in range(3)}
  script = (
    "import sys; from roformer import data; "
    f"cfg = data.DataConfig(source='files', files={cfg.files!r}, tokenizer='wordpiece', "
    "vocab_size=120); data.build_tokenizer(cfg, workdir=sys.argv[1])"
  )
  subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, capture_output=True)
  assert here == {(tmp_path / "tokenizer.json").read_text()}


def test_tokenizer_json_without_specials_gets_them_appended(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers

  backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.save(str(tmp_path / "wl.json"))
  tok = data.build_tokenizer(
    data.DataConfig(tokenizer=str(tmp_path / "wl.json")), workdir=str(tmp_path / "run")
  )
  ids = [tok.pad_id, tok.eos_id, tok.mask_id, tok.cls_id, tok.sep_id]
  assert sorted(ids) == [3, 4, 5, 6, 7] and tok.vocab_size == 8
  assert tok.encode("a b a") == [0, 1, 0]
  assert (tmp_path / "run" / "tokenizer.json").exists()  # copied into the workdir


# ---- errors ----


@pytest.mark.parametrize(
  ("overrides", "pattern"),
  [
    (dict(tokenizer="sentencepiece"), "data.tokenizer='sentencepiece'.*bytes, bpe, wordpiece"),
    (dict(tokenizer="/no/such/tokenizer.json"), "/no/such/tokenizer.json"),
    (dict(tokenizer="bpe", vocab_size=100), "data.vocab_size=100"),
  ],
)
def test_build_tokenizer_bad_config_raises_data_error(tmp_path, overrides, pattern):
  cfg = data.DataConfig(source="files", files=str(FIXTURES / "docs" / "*.txt"), **overrides)
  with pytest.raises(data.DataError, match=pattern):
    data.build_tokenizer(cfg, workdir=str(tmp_path))


def test_build_tokenizer_not_json_raises_data_error(tmp_path):
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(data.DataError, match="bad.json.*not a tokenizers JSON"):
    data.build_tokenizer(data.DataConfig(tokenizer=str(tmp_path / "bad.json")), workdir="")


def test_build_tokenizer_workdir_of_other_kind_raises_data_error(tmp_path):
  cfg = data.DataConfig(
    source="files",
    files=str(FIXTURES / "records.jsonl"),
    tokenizer="wordpiece",
    vocab_size=120,
    cache_dir=str(tmp_path / "c"),
  )
  data.build_tokenizer(cfg, workdir=str(tmp_path))
  with pytest.raises(data.DataError, match="data.tokenizer='bpe'.*WordPiece"):
    data.build_tokenizer(
      data.DataConfig(tokenizer="bpe", cache_dir=str(tmp_path / "c")), workdir=str(tmp_path)
    )
