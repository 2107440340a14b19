"""Synthetic length-generalisation tasks as a data source (`data.source=synthetic`).

Every example is a token sequence with some tokens marked as the answer; a decoder is trained on
next-token prediction with weight 1 on answer targets only, and scored by whether it predicts the
answer (roformer/evals/task_vs_length.py). Tokens are bytes of the `bytes` tokenizer, so
examples read as text. The task length n (`data.task_min_len`..`data.task_max_len` in training,
any n at evaluation) counts:

  copy, reverse, sort    n symbols of a-z, A-Z, 0-9, then '>', then the symbols copied /
                         reversed / sorted (byte order)
  addition               two n-digit numbers 'a+b=' then the n + 1 digits of the sum
                         (most significant first, or least significant first everywhere with
                         data.task_lsb_first)
  associative_recall     n key-value pairs, then ':' and every key once more in random order,
                         each followed by its value (multi-query associative recall as
                         Zoology's MQAR); keys are n distinct tokens of 128 (so n <= 128),
                         values letters and digits, distinct up to 62 pairs (Zoology: keys and
                         values from disjoint vocabularies, each key queried once). As in
                         Zoology the values never enter the model's input: the input shows
                         `_` where a queried value stands (`HIDDEN_ANSWERS`), so no answer can
                         be inferred from earlier answers, only looked up
  passkey                n tokens of repeated filler text with 'key=DDDDD.' hidden at a depth in
                         [0, 1] (random in training), then '?key=' and the 5 digits
                         (Mohtashami & Jaggi 2023)
  niah_multikey, niah_multivalue, variable_tracking, common_words, frequent_words
                         RULER's synthetic tasks at byte scale (Hsieh et al. 2024): n filler
                         tokens with needles or assignment chains, or a list of n words; see
                         ruler.py for each one's n, prompt and answer

A training batch is a pure function of (seed, step, global row): row g of step s draws its length
and content from `np.random.default_rng((seed, 2, s, g))`, so a resumed run and any process layout
see the same rows. Rows are padded to data.seq_len with pad tokens of weight 0 and segment id 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from roformer.data import ruler, task_text
from roformer.data.config import DataConfig
from roformer.data.task_text import example as _example
from roformer.data.task_text import ids as _ids
from roformer.data.tokenizer import ByteTokenizer
from roformer.errors import DataError

TASKS = ("copy", "reverse", "sort", "addition", "associative_recall", "passkey", *ruler.TASKS)
# Seed-sequence streams: training rows, and the fixed validation / test streams.
_TRAIN_STREAM, _SPLIT_STREAMS = 2, {"train": 3, "validation": 4, "test": 5}
# 62 symbols: with 26, strings of 32 repeat most letters and many bigrams, so copying needs far
# longer matches; with 62, a repeated trigram is rare (~0.3% of 32-symbol strings).
_LETTERS = np.frombuffer(
  b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", np.uint8
).astype(np.int32)
_DIGITS = np.frombuffer(b"0123456789", np.uint8).astype(np.int32)
_KEYS = np.arange(128, 256, dtype=np.int32)  # byte ids no text above uses
MAX_RECALL_PAIRS = len(_KEYS)
# Tasks whose answer tokens are replaced in the model's input (`pad_examples`) by this token.
HIDDEN_ANSWERS = ("associative_recall",)
HIDDEN_ID = ord("_")
PASSKEY_DIGITS = 5
_VALIDATION_TOKENS = 1 << 17  # tokens of the fixed validation / test streams


def _letters_task(order: Callable[[np.ndarray], np.ndarray]):
  def generate(rng, n, **_):
    s = rng.choice(_LETTERS, n)
    return _example([s, _ids(b">")], order(s))

  return generate


def _addition(rng, n, *, lsb_first=False, **_):
  a_digits, b_digits = rng.integers(0, 10, n), rng.integers(0, 10, n)
  a = int("".join(map(str, a_digits)))
  b = int("".join(map(str, b_digits)))
  c_digits = np.asarray([int(ch) for ch in str(a + b).zfill(n + 1)])
  if lsb_first:
    a_digits, b_digits, c_digits = a_digits[::-1], b_digits[::-1], c_digits[::-1]
  return _example([_DIGITS[a_digits], _ids(b"+"), _DIGITS[b_digits], _ids(b"=")], _DIGITS[c_digits])


def _associative_recall(rng, n, **_):
  keys = rng.choice(_KEYS, n, replace=False)
  values = rng.choice(_LETTERS, n, replace=n > len(_LETTERS))
  pairs = np.stack([keys, values], axis=1).reshape(-1)
  queried = rng.choice(n, n, replace=False)  # every key once, in random order
  queries = np.stack([keys[queried], values[queried]], axis=1).reshape(-1)
  tokens = np.concatenate([pairs, _ids(b":"), queries]).astype(np.int32)
  is_answer = np.zeros(len(tokens), bool)
  is_answer[2 * n + 2 :: 2] = True  # the value after each queried key
  return tokens, is_answer


def _passkey(rng, n, *, depth=None, **_):
  filler = task_text.filler(n)
  depth = rng.uniform() if depth is None else depth
  at = int(round(depth * n))
  key = rng.choice(_DIGITS, PASSKEY_DIGITS)
  hidden = np.concatenate([_ids(b"key="), key, _ids(b".")])
  return _example([filler[:at], hidden, filler[at:], _ids(b"?key=")], key)


GENERATORS = {
  "copy": _letters_task(lambda s: s),
  "reverse": _letters_task(lambda s: s[::-1]),
  "sort": _letters_task(np.sort),
  "addition": _addition,
  "associative_recall": _associative_recall,
  "passkey": _passkey,
  **ruler.GENERATORS,
}


def recall_without_lookup(examples) -> tuple[float, float]:
  """Expected exact match and per-token accuracy of associative recall's best predictor that
  never looks a key up. The values never enter the input, so all it knows is the pairs' values:
  it guesses one of the most frequent (ties at random) for every query. Where a model's score
  sits at this line, it has learned the values' frequencies, not retrieval.

  Args:
    examples: (tokens, is_answer) pairs of the associative_recall task.
  """
  exact, token, count = 0.0, 0.0, 0
  for tokens, is_answer in examples:
    n = int(np.flatnonzero(tokens == _ids(b":")[0])[0]) // 2
    values, counts = np.unique(tokens[1 : 2 * n : 2], return_counts=True)
    best = set(values[counts == counts.max()].tolist())
    p_B = np.asarray([1.0 / len(best) if v in best else 0.0 for v in tokens[is_answer].tolist()])
    exact += float(np.prod(p_B))
    token += float(p_B.sum())
    count += len(p_B)
  return exact / len(examples), token / max(count, 1)


def example_length(task: str, n: int) -> int:
  """Tokens in an example of task length n (its model input is one token shorter)."""
  if task in ruler.TASKS:
    return ruler.example_length(task, n)
  if task in ("copy", "reverse", "sort"):
    return 2 * n + 1
  if task == "addition":
    return 3 * n + 3
  if task == "associative_recall":
    return 4 * n + 1
  return n + len("key=.?key=") + 2 * PASSKEY_DIGITS  # passkey


def min_length(task: str) -> int:
  """The shortest task length `task` generates (1 but for common_words and frequent_words)."""
  return ruler.MIN_LENGTH.get(task, 1)


def generate(
  task: str, rng: np.random.Generator, n: int, *, lsb_first: bool = False, depth=None
) -> tuple[np.ndarray, np.ndarray]:
  """One example of task length n.

  Args:
    task: one of TASKS.
    rng: the generator every random choice is drawn from.
    n: the task length (see the module docstring).
    lsb_first: addition writes numbers least significant digit first.
    depth: passkey only, where the key sits in the filler (0 = start, 1 = end); None = random.

  Returns:
    (tokens int32 [T], is_answer bool [T]) with T = example_length(task, n).
  """
  check_length(task, n)
  return GENERATORS[task](rng, n, lsb_first=lsb_first, depth=depth)


def check_length(task: str, n: int) -> None:
  if task not in GENERATORS:
    raise DataError(f"data.task={task!r} is not one of {', '.join(TASKS)}")
  if n < 1:
    raise DataError(f"task length {n} must be >= 1")
  if task in ruler.TASKS:
    ruler.check_length(task, n)
  if task == "associative_recall" and n > MAX_RECALL_PAIRS:
    raise DataError(
      f"associative_recall has {MAX_RECALL_PAIRS} distinct keys: task length {n} is too long"
    )


def check_config(cfg: DataConfig) -> None:
  """Raises DataError naming the field for a synthetic config that cannot work."""
  if cfg.task not in TASKS:
    raise DataError(f"data.task must be one of {', '.join(TASKS)}, got {cfg.task!r}")
  if not 1 <= cfg.task_min_len <= cfg.task_max_len:
    raise DataError(
      f"data.task_min_len={cfg.task_min_len} and data.task_max_len={cfg.task_max_len} must "
      "satisfy 1 <= task_min_len <= task_max_len"
    )
  for field in ("task_min_len", "task_max_len"):
    try:
      check_length(cfg.task, getattr(cfg, field))
    except DataError as e:
      raise DataError(f"data.{field}={getattr(cfg, field)}: {e}") from None
  need = example_length(cfg.task, cfg.task_max_len) - 1
  if cfg.seq_len < need:
    raise DataError(
      f"data.seq_len={cfg.seq_len} is too short for data.task={cfg.task!r} at "
      f"data.task_max_len={cfg.task_max_len}: an example needs {need} input tokens"
    )


class SyntheticBatches:
  """Training batches of a synthetic task; `batch(step)` depends only on (seed, step, row).

  Same interface as TrainBatches: `batch(step)`, `iterate(start_step)`, `local_batch_size`.
  """

  def __init__(
    self,
    cfg: DataConfig,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
  ):
    if global_batch_size < 1 or global_batch_size % process_count:
      raise DataError(
        f"train.global_batch_size={global_batch_size} must be a positive multiple of the "
        f"process count {process_count}"
      )
    check_config(cfg)
    self.cfg = cfg
    self.tokenizer = ByteTokenizer()
    self.seq_len = cfg.seq_len
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.seed = seed
    self._rows = process_index * self.local_batch_size + np.arange(self.local_batch_size)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of step `step`: inputs, targets, positions, segment_ids int32 [B, L]
    and weights float32 [B, L] (1 on answer targets only)."""
    if step < 0:
      raise ValueError(f"step={step} must be >= 0")
    examples = []
    for row in self._rows.tolist():
      rng = np.random.default_rng((self.seed, _TRAIN_STREAM, step, row))
      n = int(rng.integers(self.cfg.task_min_len, self.cfg.task_max_len + 1))
      examples.append(generate(self.cfg.task, rng, n, lsb_first=self.cfg.task_lsb_first))
    return pad_examples(
      examples,
      self.seq_len,
      pad_id=self.tokenizer.pad_id,
      hide_answers=self.cfg.task in HIDDEN_ANSWERS,
    )

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    step = start_step
    while True:
      yield self.batch(step)
      step += 1


def pad_examples(
  examples, seq_len: int, *, pad_id: int, hide_answers: bool = False
) -> dict[str, np.ndarray]:
  """Model rows of `seq_len` from (tokens, is_answer) examples: inputs are tokens[:-1], targets
  tokens[1:], weight 1 where the target is an answer token; the tail is padding (segment 0).
  With `hide_answers` (the tasks of HIDDEN_ANSWERS) an answer token is HIDDEN_ID as an input."""
  B = len(examples)
  inputs = np.full((B, seq_len), pad_id, np.int32)
  targets = np.full((B, seq_len), pad_id, np.int32)
  weights = np.zeros((B, seq_len), np.float32)
  segment_ids = np.zeros((B, seq_len), np.int32)
  for i, (tokens, is_answer) in enumerate(examples):
    t = len(tokens) - 1
    if t > seq_len:
      raise DataError(f"an example of {t} input tokens does not fit data.seq_len={seq_len}")
    inputs[i, :t], targets[i, :t] = tokens[:-1], tokens[1:]
    if hide_answers:
      inputs[i, :t] = np.where(is_answer[:-1], HIDDEN_ID, tokens[:-1])
    weights[i, :t] = is_answer[1:]
    segment_ids[i, :t] = 1
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (B, seq_len)).copy()
  return {
    "inputs": inputs,
    "targets": targets,
    "positions": positions,
    "segment_ids": segment_ids,
    "weights": weights,
  }


class _SyntheticSource:
  def __init__(self, cfg: DataConfig):
    self.cfg = cfg

  def describe(self) -> str:
    return f"data.source='synthetic' (data.task={self.cfg.task!r})"


class SyntheticCorpus:
  """The Corpus interface over a synthetic task (what training and eval.py use of a corpus).

  `tokens(split)` is a fixed stream of examples at training lengths, each followed by EOS, for
  the perplexity evaluation (its loss covers every token, not just the answers);
  `train_batches` gives the answer-weighted training rows.
  """

  def __init__(self, cfg: DataConfig):
    check_config(cfg)
    self.cfg = cfg
    self.tokenizer = ByteTokenizer()
    self.source = _SyntheticSource(cfg)
    self._tokens: dict[str, np.ndarray] = {}

  def tokens(self, split: str) -> np.ndarray:
    if split not in _SPLIT_STREAMS:
      raise DataError(f"split={split!r} is not one of {', '.join(_SPLIT_STREAMS)}")
    if split not in self._tokens:
      rng = np.random.default_rng((_SPLIT_STREAMS[split],))
      eos = np.asarray([self.tokenizer.eos_id], np.int32)
      pieces, total = [], 0
      while total < _VALIDATION_TOKENS:
        n = int(rng.integers(self.cfg.task_min_len, self.cfg.task_max_len + 1))
        tokens, _ = generate(self.cfg.task, rng, n, lsb_first=self.cfg.task_lsb_first)
        pieces += [tokens, eos]
        total += len(tokens) + 1
      self._tokens[split] = np.concatenate(pieces)
    return self._tokens[split]

  def train_batches(
    self, cfg: DataConfig, *, model_kind: str, global_batch_size: int, seed: int, **kwargs
  ) -> SyntheticBatches:
    if model_kind != "decoder":
      raise DataError(
        "data.source='synthetic' trains decoders (next-token answers); "
        f"got model.kind={model_kind!r}"
      )
    return SyntheticBatches(cfg, global_batch_size=global_batch_size, seed=seed, **kwargs)
