"""Tests of roformer.data.synthetic: hand-checked examples, oracles, determinism, validation."""

import dataclasses

import numpy as np
import pytest

from roformer.data import ruler, synthetic
from roformer.data.config import DataConfig
from roformer.data.tokenizer import ByteTokenizer
from roformer.errors import DataError

TOK = ByteTokenizer()


class PresetRng:
  """Stands in for np.random.Generator: preset draws in order (to build examples by hand)."""

  def __init__(self, *draws):
    self.draws = list(draws)

  def choice(self, a, size=None, replace=True):
    return np.asarray(self.draws.pop(0))

  def integers(self, low, high=None, size=None):
    return np.asarray(self.draws.pop(0))

  def uniform(self):
    return self.draws.pop(0)


def text(tokens):
  return bytes(int(t) for t in tokens).decode("latin-1")


def split(task, rng, n, **kwargs):
  tokens, is_answer = synthetic.generate(task, rng, n, **kwargs)
  return text(tokens[~is_answer]), text(tokens[is_answer]), tokens, is_answer


@pytest.mark.parametrize(("task", "answer"), [("copy", "cab"), ("reverse", "bac"), ("sort", "abc")])
def test_letter_tasks_hand_checked(task, answer):
  prompt, got, _, _ = split(task, PresetRng([ord("c"), ord("a"), ord("b")]), 3)
  assert (prompt, got) == ("cab>", answer)


def test_addition_hand_checked_in_both_digit_orders():
  draws = ([9, 0, 5], [1, 2, 7])
  assert split("addition", PresetRng(*draws), 3)[:2] == ("905+127=", "1032")
  assert split("addition", PresetRng(*draws), 3, lsb_first=True)[:2] == ("509+721=", "2301")


def test_associative_recall_hand_checked():
  # Zoology's MQAR: every key queried once, in random order; values never in the model's input.
  k = synthetic._KEYS
  draws = ([k[0], k[1], k[2]], [ord("c"), ord("a"), ord("d")], [2, 0, 1])
  _, answer, tokens, is_answer = split("associative_recall", PresetRng(*draws), 3)
  want = [k[0], ord("c"), k[1], ord("a"), k[2], ord("d"), ord(":"), k[2], ord("d"), k[0], ord("c")]
  want += [k[1], ord("a")]
  assert tokens.tolist() == want
  assert answer == "dca" and np.flatnonzero(is_answer).tolist() == [8, 10, 12]
  rows = synthetic.pad_examples([(tokens, is_answer)], 14, pad_id=0, hide_answers=True)
  hidden = [k[0], ord("c"), k[1], ord("a"), k[2], ord("d"), ord(":"), k[2], ord("_"), k[0]]
  hidden += [ord("_"), k[1], 0, 0]  # the last answer is only ever a target; then padding
  assert rows["inputs"][0].tolist() == hidden
  assert rows["targets"][0, [7, 9, 11]].tolist() == [ord("d"), ord("c"), ord("a")]
  assert rows["weights"][0].nonzero()[0].tolist() == [7, 9, 11]


def test_associative_recall_values_are_distinct_up_to_62_pairs_and_keys_always():
  rng = np.random.default_rng(0)
  for n in (16, 62, 128):
    tokens, _ = synthetic.generate("associative_recall", rng, n)
    keys, values = tokens[: 2 * n : 2], tokens[1 : 2 * n : 2]
    assert len(set(keys.tolist())) == n
    assert len(set(values.tolist())) == min(n, 62) or n > 62


def test_recall_without_lookup_guesses_the_most_frequent_value():
  k = synthetic._KEYS
  # Values c, c, a: the guess is c, right for 2 of the 3 queries, never all three.
  tokens = np.asarray([k[0], 99, k[1], 99, k[2], 97, 58, k[0], 99, k[1], 99, k[2], 97], np.int32)
  is_answer = np.zeros(13, bool)
  is_answer[8::2] = True
  assert synthetic.recall_without_lookup([(tokens, is_answer)]) == (0.0, pytest.approx(2 / 3))
  # Distinct values: 1/n per query.
  examples = [synthetic.generate("associative_recall", np.random.default_rng(i), 8)
              for i in range(10)]  # fmt: skip
  exact, token = synthetic.recall_without_lookup(examples)
  assert token == pytest.approx(1 / 8) and exact == pytest.approx(8.0**-8)


def test_passkey_hand_checked():
  key = [ord(c) for c in "12345"]
  prompt, answer, _, _ = split("passkey", PresetRng(key), 10, depth=0.5)
  # 10 filler tokens "The grass ", the key after round(0.5 * 10) = 5 of them.
  assert (prompt, answer) == ("The gkey=12345.rass ?key=", "12345")
  # Random depth comes from rng.uniform(), drawn before the key.
  prompt, _, _, _ = split("passkey", PresetRng(0.0, [ord("0")] * 5), 4)
  assert prompt == "key=00000.The ?key="


# ---- Oracles: the answer is recoverable from the prompt ----


def oracle(task, tokens, is_answer, lsb_first=False):
  """Predicts every answer token from the tokens before it (never reading an answer token)."""
  first = int(np.argmax(is_answer))
  prompt = text(tokens[:first])
  if task in ("copy", "reverse", "sort"):
    s = prompt[:-1]
    return {"copy": s, "reverse": s[::-1], "sort": "".join(sorted(s))}[task]
  if task == "addition":
    a, b = prompt[:-1].split("+")
    if lsb_first:
      a, b = a[::-1], b[::-1]
    c = str(int(a) + int(b)).zfill(len(a) + 1)
    return c[::-1] if lsb_first else c
  if task == "associative_recall":
    n = (first - 2) // 2  # pairs, ':', first queried key, then its value is the first answer
    # The oracle reads keys only: never a value of the query section (hidden from the model).
    table = {tokens[2 * i]: tokens[2 * i + 1] for i in range(n)}
    return text([table[tokens[t - 1]] for t in np.flatnonzero(is_answer)])
  start = prompt.index("key=") + 4
  return prompt[start : start + 5]


# RULER's tasks have their reference solver in ruler_test.py.
@pytest.mark.parametrize("task", [t for t in synthetic.TASKS if t not in ruler.TASKS])
def test_a_perfect_oracle_gets_every_example_right(task):
  rng = np.random.default_rng(0)
  for n in (1, 3, 8, 32, 100):
    for lsb_first in (False, True) if task == "addition" else (False,):
      for _ in range(20):
        tokens, is_answer = synthetic.generate(task, rng, n, lsb_first=lsb_first)
        assert len(tokens) == synthetic.example_length(task, n)
        assert oracle(task, tokens, is_answer, lsb_first) == text(tokens[is_answer])


# ---- Batches ----


def cfg(**fields):
  base = dict(source="synthetic", task="copy", task_min_len=2, task_max_len=6, seq_len=16)
  return DataConfig(**{**base, **fields})


def batches(c=None, **kwargs):
  return synthetic.SyntheticBatches(c or cfg(), global_batch_size=4, seed=7, **kwargs)


def test_batches_are_identical_across_runs_resumes_and_process_layouts():
  a, b = batches(), batches()
  for key, value in a.batch(11).items():
    np.testing.assert_array_equal(value, b.batch(11)[key])
  resumed = next(b.iterate(11))
  np.testing.assert_array_equal(resumed["inputs"], a.batch(11)["inputs"])
  assert not np.array_equal(a.batch(11)["inputs"], a.batch(12)["inputs"])
  halves = [batches(process_index=i, process_count=2).batch(11) for i in range(2)]
  np.testing.assert_array_equal(
    np.concatenate([h["inputs"] for h in halves]), a.batch(11)["inputs"]
  )
  other_seed = synthetic.SyntheticBatches(cfg(), global_batch_size=4, seed=8)
  assert not np.array_equal(other_seed.batch(11)["inputs"], a.batch(11)["inputs"])


def test_batch_weights_cover_exactly_the_answer_targets():
  batch = batches(cfg(task="reverse")).batch(3)
  for row in range(4):
    t = int(batch["segment_ids"][row].sum())
    prompt = text(batch["inputs"][row, : t // 2 + 1])
    n = t // 2
    assert prompt.endswith(">") and len(prompt) == n + 1
    weighted = batch["targets"][row][batch["weights"][row] == 1]
    assert text(weighted) == prompt[:-1][::-1]
    assert np.all(batch["inputs"][row, t:] == TOK.pad_id) and batch["weights"][row, t:].sum() == 0
    assert 2 <= n <= 6
  np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(16), (4, 1)))


def test_lengths_cover_the_training_range():
  lengths = {int(r.sum()) // 2 for s in range(30) for r in batches().batch(s)["segment_ids"]}
  assert lengths == set(range(2, 7))


@pytest.mark.parametrize(
  ("fields", "match"),
  [
    (dict(task="bogus"), "data.task must be one of copy, reverse"),
    (dict(task_min_len=5, task_max_len=4), "data.task_min_len=5 and data.task_max_len=4"),
    (dict(seq_len=10), "data.seq_len=10 is too short for data.task='copy'.* needs 12 input tokens"),
    (dict(task="associative_recall", task_max_len=200, seq_len=999), "128 distinct keys"),
  ],
)
def test_bad_synthetic_configs_name_the_field(fields, match):
  with pytest.raises(DataError, match=match):
    synthetic.check_config(cfg(**fields))


def test_corpus_streams_are_fixed_and_encoders_are_refused():
  corpus = synthetic.SyntheticCorpus(cfg())
  again = synthetic.SyntheticCorpus(cfg())
  np.testing.assert_array_equal(corpus.tokens("validation"), again.tokens("validation"))
  assert not np.array_equal(corpus.tokens("validation")[:100], corpus.tokens("test")[:100])
  assert (corpus.tokens("validation") == TOK.eos_id).sum() > 100
  with pytest.raises(DataError, match="model.kind='encoder'"):
    corpus.train_batches(cfg(), model_kind="encoder", global_batch_size=4, seed=0)
  assert dataclasses.replace(cfg(), task="sort").task == "sort"
