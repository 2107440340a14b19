"""Tokenizers: raw bytes, or a Hugging Face `tokenizers` BPE / WordPiece trained on the corpus.

Every tokenizer has the five special tokens pad, eos, mask, cls and sep. The bytes tokenizer
maps byte b to id b (0..255) and the specials to 256..260 (vocab_size 261). Special tokens are
never produced from text: a literal "<|eos|>" in a document is encoded as ordinary text.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import tokenizers as hf_tokenizers
from etils import epath
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from roformer.data.config import TOKENIZERS, DataConfig
from roformer.errors import DataError

if TYPE_CHECKING:
  from roformer.data.sources import Source

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
ROLES = ("pad", "eos", "mask", "cls", "sep")
# Special tokens of the tokenizers trained here, in id order (ids 0..4; WordPiece adds [UNK] = 5).
BPE_SPECIALS = ("<|pad|>", "<|eos|>", "<|mask|>", "<|cls|>", "<|sep|>")
WORDPIECE_SPECIALS = ("[PAD]", "[EOS]", "[MASK]", "[CLS]", "[SEP]", "[UNK]")
# Names recognised in a user-supplied tokenizer.json, first match wins.
_ROLE_NAMES = {
  "pad": ("<|pad|>", "[PAD]", "<pad>"),
  "eos": ("<|eos|>", "[EOS]", "<|endoftext|>", "</s>", "<eos>"),
  "mask": ("<|mask|>", "[MASK]", "<mask>"),
  "cls": ("<|cls|>", "[CLS]", "<s>", "<cls>"),
  "sep": ("<|sep|>", "[SEP]", "</s>", "<sep>"),
}


class Tokenizer:
  """Text <-> int ids, with special-token ids `pad_id`, `eos_id`, `mask_id`, `cls_id`, `sep_id`."""

  kind: str
  vocab_size: int
  pad_id: int
  eos_id: int
  mask_id: int
  cls_id: int
  sep_id: int

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without special tokens."""
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; special tokens are dropped."""
    raise NotImplementedError

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Ids of several documents, as int32 arrays (parallel where the backend allows)."""
    raise NotImplementedError

  def save(self, path: str | epath.Path) -> None:
    """Writes a `tokenizers` JSON file that `data.tokenizer=PATH` loads with identical ids."""
    raise NotImplementedError

  @property
  def fingerprint(self) -> str:
    """A string that changes whenever the mapping from text to ids changes (cache key)."""
    raise NotImplementedError

  @property
  def special_ids(self) -> np.ndarray:
    """int32 [S]: every special id (never masked, never drawn as a random replacement)."""
    return np.asarray(sorted({self.pad_id, self.eos_id, self.mask_id, self.cls_id, self.sep_id}))

  @functools.cached_property
  def regular_ids(self) -> np.ndarray:
    """int32 [V - S]: the ids that text can produce."""
    ids = np.arange(self.vocab_size, dtype=np.int32)
    return ids[~np.isin(ids, self.special_ids)]


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes: id b for byte b; pad 256, eos 257, mask 258, cls 259, sep 260."""

  kind = "bytes"
  vocab_size = 261
  pad_id, eos_id, mask_id, cls_id, sep_id = 256, 257, 258, 259, 260

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
    data = ids_N[(ids_N >= 0) & (ids_N < 256)].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

  def save(self, path: str | epath.Path) -> None:
    # The same mapping as a byte-level BPE without merges: byte b is the vocabulary entry b.
    byte_chars = _bytes_to_unicode()
    tok = hf_tokenizers.Tokenizer(
      models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BPE_SPECIALS))
    epath.Path(path).write_text(tok.to_str())

  @property
  def fingerprint(self) -> str:
    return "bytes-v1"


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizers.Tokenizer` with the five special tokens resolved."""

  def __init__(self, tok: hf_tokenizers.Tokenizer, *, kind: str):
    self.kind = kind
    self._tok = tok
    tok.no_padding()
    tok.no_truncation()
    for role in ROLES:
      token_id = next(
        (tok.token_to_id(n) for n in _ROLE_NAMES[role] if tok.token_to_id(n) is not None), None
      )
      if token_id is None:
        name = f"<|{role}|>"
        tok.add_special_tokens([name])
        token_id = tok.token_to_id(name)
        log.warning("Tokenizer has no %s token; added %r as id %d.", role, name, token_id)
      setattr(self, f"{role}_id", token_id)
    # Text containing e.g. "<|eos|>" must stay text, so that decode(encode(x)) == x for any x.
    tok.encode_special_tokens = True
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> hf_tokenizers.Tokenizer:
    return self._tok

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

  def save(self, path: str | epath.Path) -> None:
    epath.Path(path).write_text(self._tok.to_str())

  @functools.cached_property
  def fingerprint(self) -> str:
    return "tokenizers-" + hashlib.sha256(self._tok.to_str().encode()).hexdigest()

  @functools.cached_property
  def special_ids(self) -> np.ndarray:
    added = [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]
    return np.asarray(sorted(set(added) | set(super().special_ids.tolist())))


def build_tokenizer(cfg: DataConfig, *, workdir: str, source: Source | None = None) -> Tokenizer:
  """Returns the tokenizer of `cfg.tokenizer`, training or loading it as needed.

  "bpe" / "wordpiece" load WORKDIR/tokenizer.json when it exists, else train on the training split
  (at most `cfg.tokenizer_max_chars` characters) to `cfg.vocab_size` and save it there. A path
  ending in ".json" is loaded and copied to WORKDIR/tokenizer.json. "bytes" needs no file.

  Args:
    cfg: the data config.
    workdir: run directory ("" = do not save a trained tokenizer).
    source: the corpus source to train on (default: `make_source(cfg)`).
  """
  name = cfg.tokenizer
  if name == "bytes":
    return ByteTokenizer()
  saved = epath.Path(workdir) / TOKENIZER_FILE if workdir else None
  if name.endswith(".json"):
    tok = HFTokenizer(_read_tokenizer_json(epath.Path(name), field="data.tokenizer"), kind="json")
    if saved is not None and os.path.abspath(os.fspath(saved)) != os.path.abspath(name):
      saved.parent.mkdir(parents=True, exist_ok=True)
      tok.save(saved)
    return tok
  if name not in ("bpe", "wordpiece"):
    raise DataError(
      f"data.tokenizer={name!r} is not one of {', '.join(TOKENIZERS)} or a path ending in .json"
    )
  if saved is not None and saved.exists():
    backend = _read_tokenizer_json(saved, field="the saved tokenizer")
    model_type = json.loads(backend.to_str())["model"]["type"]
    expected = {"bpe": "BPE", "wordpiece": "WordPiece"}[name]
    if model_type != expected:
      raise DataError(
        f"data.tokenizer={name!r} but {saved} holds a {model_type} tokenizer; use a fresh workdir"
      )
    log.info("Loaded the %s tokenizer from %s.", name, saved)
    return HFTokenizer(backend, kind=name)
  if source is None:
    from roformer.data.sources import make_source  # local: `datasets` loads only to train one

    source = make_source(cfg)
  tok = HFTokenizer(_train(name, cfg, source), kind=name)
  if saved is not None:
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.parent / f".{TOKENIZER_FILE}.{uuid.uuid4().hex}.tmp"
    tok.save(tmp)
    tmp.rename(saved)  # several processes may train the same (deterministic) tokenizer at once
    log.info("Saved the %s tokenizer to %s.", name, saved)
  return tok


def _read_tokenizer_json(path: epath.Path, *, field: str) -> hf_tokenizers.Tokenizer:
  if not path.exists():
    raise DataError(f"{field}: tokenizer file {str(path)!r} does not exist")
  try:
    return hf_tokenizers.Tokenizer.from_str(path.read_text())
  except Exception as e:  # the Rust error type is not exported
    raise DataError(f"{field}: {str(path)!r} is not a tokenizers JSON file ({e})") from e


def _train(kind: str, cfg: DataConfig, source: Source) -> hf_tokenizers.Tokenizer:
  specials = BPE_SPECIALS if kind == "bpe" else WORDPIECE_SPECIALS
  min_vocab = 256 + len(specials) if kind == "bpe" else len(specials) + 1
  if cfg.vocab_size < min_vocab:
    raise DataError(
      f"data.vocab_size={cfg.vocab_size} is below {min_vocab}, the minimum for {kind}"
    )
  log.info(
    "Training a %s tokenizer (vocab_size %d) on %s.", kind, cfg.vocab_size, source.describe()
  )
  texts = _training_texts(source, cfg.tokenizer_max_chars)
  if kind == "wordpiece":
    return _train_wordpiece(texts, cfg.vocab_size)
  # Byte-level BPE without a normalizer is lossless: decode(encode(x)) == x.
  tok = hf_tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=cfg.vocab_size,
    special_tokens=list(specials),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  return tok


def _train_wordpiece(texts: Iterator[list[str]], vocab_size: int) -> hf_tokenizers.Tokenizer:
  """A BERT-style, cased WordPiece vocabulary that depends only on the texts.

  `tokenizers`' WordPieceTrainer is a BPE trainer whose continuation pieces ("##c") get their
  ids in the order of a randomly seeded hash map, and ties between equally frequent merges are
  broken by id: two trainings on the same text give different vocabularies (a thread count does
  not change that). Its plain BPE trainer, given words without a prefix, numbers every symbol in
  sorted order and is deterministic. So each word is written with its non-initial characters
  replaced by private-use twins (the "##" symbols as characters of their own), a plain BPE is
  trained on those words, and its vocabulary is mapped back to WordPiece pieces ("##" + the
  characters of a piece that starts with a twin): the vocabulary WordPieceTrainer trains, with
  its ties broken and its ids in a fixed order. Whitespace is not preserved, so decode is
  approximate.
  """
  tok = hf_tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  words: dict[str, int] = {}
  for batch in texts:
    for text in batch:
      for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)):
        words[word] = words.get(word, 0) + 1
  alphabet = sorted({c for word in words for c in word})
  twins = list(itertools.islice(_private_use_chars(exclude=set(alphabet)), len(alphabet)))
  if len(twins) < len(alphabet):
    raise DataError(
      f"the text has {len(alphabet):,} distinct characters, more than the {len(twins):,} "
      "private-use characters the WordPiece training maps them to: use data.tokenizer=bpe or bytes"
    )
  to_twin = dict(zip(alphabet, twins, strict=True))
  from_twin = {twin: c for c, twin in to_twin.items()}
  # A plain BPE over single words: no normalizer or pre-tokenizer, each sequence is one word.
  bpe = hf_tokenizers.Tokenizer(models.BPE())
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(WORDPIECE_SPECIALS),
    initial_alphabet=alphabet,  # as WordPieceTrainer: every character also as a word start
    show_progress=False,
  )
  twinned = {word[0] + "".join(to_twin[c] for c in word[1:]): n for word, n in words.items()}
  bpe.train_from_iterator(_repeated(twinned), trainer)
  vocab = {}
  for piece, token_id in bpe.get_vocab(with_added_tokens=False).items():
    if piece in WORDPIECE_SPECIALS:
      vocab[piece] = token_id
    elif piece[0] in from_twin:
      vocab["##" + "".join(from_twin[c] for c in piece)] = token_id
    else:
      vocab[piece[0] + "".join(from_twin[c] for c in piece[1:])] = token_id
  tok.model = models.WordPiece(vocab, unk_token="[UNK]")
  tok.add_special_tokens(list(WORDPIECE_SPECIALS))
  return tok


def _repeated(counts: dict[str, int]) -> Iterator[list[str]]:
  """Each word as often as it occurs, in batches (the trainer counts the words itself)."""
  batch: list[str] = []
  for word, count in counts.items():
    batch.extend([word] * count)
    if len(batch) >= 4096:
      yield batch
      batch = []
  if batch:
    yield batch


def _private_use_chars(*, exclude: set[str]) -> Iterator[str]:
  """Characters of the supplementary private use planes (15, 16), those in `exclude` skipped."""
  for code in (*range(0xF0000, 0xFFFFE), *range(0x100000, 0x10FFFE)):
    if chr(code) not in exclude:
      yield chr(code)


def _training_texts(source: Source, max_chars: int) -> Iterator[list[str]]:
  budget = max_chars if max_chars > 0 else float("inf")
  for batch in source.documents("train").iter(batch_size=256):
    texts = [t for t in batch["text"] if t]
    keep = []
    for t in texts:
      if budget <= 0:
        break
      keep.append(t[: int(min(len(t), budget))])
      budget -= len(keep[-1])
    yield keep
    if budget <= 0:
      return


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
  bs = [
    *range(ord("!"), ord("~") + 1),
    *range(ord("¡"), ord("¬") + 1),
    *range(ord("®"), ord("ÿ") + 1),
  ]
  cs = list(bs)
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs, strict=True)}
