"""Tests of roformer.data.ruler (RULER's tasks at byte scale): hand-checked examples, a reference
solver that reads the prompt (positive control) and corrupted prompts that defeat it (negative
controls), lengths, determinism and validation."""

import collections
import re

import numpy as np
import pytest

from roformer.data import ruler, synthetic
from roformer.data.config import DataConfig
from roformer.errors import DataError
from tests.data import synthetic_test

RULER = ruler.TASKS


class PresetRng(synthetic_test.PresetRng):
  """synthetic_test's preset draws, with permutation too."""

  def permutation(self, x):
    return np.asarray(self.draws.pop(0))


def text(tokens) -> str:
  return bytes(int(t) for t in tokens).decode("latin-1")


def split(task, rng, n):
  tokens, is_answer = synthetic.generate(task, rng, n)
  return text(tokens[~is_answer]), text(tokens[is_answer]), tokens, is_answer


# ---- Hand-checked examples: the format of each task ----


def test_niah_multikey_hand_checked():
  # Keys AAA..AAD, values 12345 00000 99999 00042, needles at offsets 0, 3, 3, 10 (drawn
  # unsorted), key 2 queried; the filler's first 10 tokens are "The grass ".
  rng = PresetRng([0, 1, 2, 3], [12345, 0, 99999, 42], [10, 3, 0, 3], 2)
  prompt, answer, _, _ = split("niah_multikey", rng, 10)
  assert prompt == "AAA=12345.TheAAB=00000.AAC=99999. grass AAD=00042.?AAC="
  assert answer == "99999"


def test_niah_multivalue_hand_checked():
  rng = PresetRng([0], [1, 2, 3, 4], [10, 0, 5, 5])
  prompt, answer, _, _ = split("niah_multivalue", rng, 10)
  assert prompt == "AAA=00001.The gAAA=00002.AAA=00003.rass AAA=00004.?AAA="
  assert answer == "00001,00002,00003,00004"


def test_variable_tracking_hand_checked():
  # Chains AAA..AAE (value 11111) and AAF..AAJ (value 22222), interleaved in the drawn order,
  # each in its own order; the second chain is queried.
  order = [0, 0, 1, 1, 0, 1, 0, 1, 0, 1]
  rng = PresetRng(list(range(10)), [11111, 22222], order, [0, 0, 0, 0, 0, 2, 2, 2, 4, 4], 1)
  prompt, answer, _, _ = split("variable_tracking", rng, 4)
  lines = ["AAA=11111.", "AAB=AAA.", "AAF=22222.", "AAG=AAF.", "AAC=AAB.", "AAH=AAG.",
           "AAD=AAC.", "AAI=AAH.", "AAE=AAD.", "AAJ=AAI."]  # fmt: skip
  want = "".join(lines[:5]) + "Th" + "".join(lines[5:8]) + "e " + "".join(lines[8:]) + "?22222:"
  assert (prompt, answer) == (want, "AAF,AAG,AAH,AAI,AAJ")


def test_common_words_hand_checked():
  # 20 words: aaa, aab, aac 6 times each, aad and aae once; the answer is the common words in
  # the order they first appear.
  listed = [3, 1, 0, 0, 2, 1, 4, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
  rng = PresetRng([0, 1, 2, 3, 4], listed)
  prompt, answer, _, _ = split("common_words", rng, 20)
  words = ["aaa", "aab", "aac", "aad", "aae"]
  assert prompt == " ".join(words[i] for i in listed) + "?common="
  assert answer == "aab,aaa,aac"


def test_zipf_counts_hand_checked():
  # floor(n / (k^2 zeta(2))) for k >= 2, zeta(2) = 1.6449; the noise word takes the rest.
  # n = 53: 8.05, 3.58, 2.01, 1.13, 0.90 -> 8, 3, 2, 1; n = 100: 15.2, 6.75, 3.8, 2.43, 1.69, 1.24.
  assert ruler.zipf_counts(53).tolist() == [53 - 14, 8, 3, 2, 1]
  assert ruler.zipf_counts(100).tolist() == [100 - 28, 15, 6, 3, 2, 1, 1]


def test_frequent_words_hand_checked():
  counts = [39, 8, 3, 2, 1]
  listed = np.repeat(np.arange(5), counts)  # "shuffled" into sorted order
  prompt, answer, _, _ = split("frequent_words", PresetRng([0, 1, 2, 3], listed), 53)
  words = ["...", "aaa", "aab", "aac", "aad"]
  assert prompt == " ".join(words[i] for i in listed) + "?frequent="
  assert answer == "aaa,aab,aac"  # by frequency; the noise word "..." is never an answer


# ---- A reference solver: the answer is recoverable from the prompt ----

STATEMENT = re.compile(r"([A-Z]{3})=([A-Z]{3}|\d{5})\.")


def solve(task: str, prompt: str) -> str | None:
  """The answer from the prompt alone, by the task's definition; None where the prompt does not
  determine one (no needle for the key, tied counts)."""
  context, query = prompt.rsplit("?", 1)
  if task in ("niah_multikey", "niah_multivalue"):
    values = [v for k, v in STATEMENT.findall(context) if k == query[:-1]]
    if task == "niah_multikey":
      return values[0] if len(values) == 1 else None
    return ",".join(values) or None
  if task == "variable_tracking":
    holds = {}
    for name, rhs in STATEMENT.findall(context):
      holds[name] = rhs if rhs.isdigit() else holds.get(rhs)
    return ",".join(name for name, value in holds.items() if value == query[:-1]) or None
  words = context.split(" ")
  counts = collections.Counter(w for w in words if w != ruler.NOISE_WORD.decode())
  ranked = counts.most_common()
  k = ruler.CWE_COMMON if task == "common_words" else ruler.FWE_TOP
  if len(ranked) <= k or ranked[k - 1][1] == ranked[k][1]:
    return None  # the k-th and (k+1)-th most frequent tie: no top k
  if task == "common_words":
    top = {w for w, _ in ranked[:k]}
    return ",".join(w for w in dict.fromkeys(words) if w in top)
  if len({c for _, c in ranked[:k]}) < k:
    return None  # no order by frequency
  return ",".join(w for w, _ in ranked[:k])


def lengths(task):
  low = synthetic.min_length(task)
  return (low, low + 1, low + 7, 2 * low + 50, 300)


@pytest.mark.parametrize("task", RULER)
def test_the_reference_solver_recovers_every_answer_from_the_prompt(task):
  rng = np.random.default_rng(0)
  for n in lengths(task):
    for _ in range(20):
      prompt, answer, tokens, is_answer = split(task, rng, n)
      assert len(tokens) == synthetic.example_length(task, n)
      # The answer is exactly the tail: the prompt ends with the query marker.
      assert np.flatnonzero(is_answer).tolist() == list(range(len(prompt), len(tokens)))
      assert prompt.endswith(("=", ":")) and solve(task, prompt) == answer


@pytest.mark.parametrize("task", RULER)
def test_a_shuffled_prompt_defeats_the_solver(task):
  rng = np.random.default_rng(1)
  for n in lengths(task)[:3]:
    for _ in range(10):
      prompt, answer, _, _ = split(task, rng, n)
      body, query = prompt.rsplit("?", 1)
      shuffled = "".join(rng.permutation(list(body)))
      assert solve(task, shuffled + "?" + query) != answer


def swap(s: str, a: str, b: str) -> str:
  """s with every a and b exchanged."""
  return re.sub(f"{re.escape(a)}|{re.escape(b)}", lambda m: b if m.group() == a else a, s)


def corrupt(task: str, prompt: str, answer: str, rng) -> str:
  """The prompt changed in the one fact the answer rests on."""
  context, query = prompt.rsplit("?", 1)
  statements = STATEMENT.findall(context)
  if task == "niah_multikey":  # the queried needle takes a distractor's value
    other = next(v for k, v in statements if k != query[:-1])
    return swap(context, answer, other) + "?" + query
  if task == "niah_multivalue":  # two of the values trade places in the text
    first, last = statements[0][1], statements[-1][1]
    return swap(context, first, last) + "?" + query
  if task == "variable_tracking":  # the query asks for the other chain's value
    other = next(v for _, v in statements if v.isdigit() and v != query[:-1])
    return context + "?" + other + ":"
  words = context.split(" ")
  if task == "common_words":  # one common word keeps a single occurrence
    word = answer.split(",")[0]
    seen = [i for i, w in enumerate(words) if w == word]
    for j, i in enumerate(seen[1:]):
      words[i] = f"{j}{word[1:]}"  # fresh words, never in the list (digits)
    return " ".join(words) + "?" + query
  # frequent_words: the most frequent answer word trades places with the rarest word.
  rarest = collections.Counter(words).most_common()[-1][0]
  return swap(context, answer.split(",")[0], rarest) + "?" + query


@pytest.mark.parametrize("task", RULER)
def test_a_prompt_corrupted_in_the_answers_fact_changes_the_solvers_answer(task):
  rng = np.random.default_rng(2)
  for n in lengths(task)[:4]:
    for _ in range(10):
      prompt, answer, _, _ = split(task, rng, n)
      assert solve(task, corrupt(task, prompt, answer, rng)) != answer


def test_niah_multikey_distractors_are_real_needles():
  # A solver that ignores the key (the first needle's value) is right about 1 / NIAH_KEYS of the
  # time; the key is what picks the needle.
  rng = np.random.default_rng(3)
  hits = []
  for _ in range(400):
    prompt, answer, _, _ = split("niah_multikey", rng, 40)
    statements = STATEMENT.findall(prompt)
    assert len({k for k, _ in statements}) == len({v for _, v in statements}) == ruler.NIAH_KEYS
    hits.append(statements[0][1] == answer)
  assert 0.15 < np.mean(hits) < 0.35


def test_variable_tracking_chains_appear_in_order_and_the_query_matters():
  rng = np.random.default_rng(4)
  for _ in range(50):
    prompt, answer, _, _ = split("variable_tracking", rng, 30)
    statements = STATEMENT.findall(prompt.rsplit("?", 1)[0])
    assert len(statements) == ruler.VT_CHAINS * (ruler.VT_HOPS + 1)
    names = answer.split(",")
    assert [n for n, _ in statements if n in names] == names  # assigned in chain order
    for hop in range(1, len(names)):
      assert (names[hop], names[hop - 1]) in statements


def test_common_words_counts_and_frequent_words_ranks():
  rng = np.random.default_rng(5)
  for n in (19, 40, 200):
    prompt, answer, _, _ = split("common_words", rng, n)
    counts = collections.Counter(prompt.rsplit("?", 1)[0].split(" "))
    assert sum(counts.values()) == n
    assert sorted(counts.values(), reverse=True)[: ruler.CWE_COMMON + 1] == [6, 6, 6, 1]
    assert {counts[w] for w in answer.split(",")} == {ruler.CWE_COMMON_REPEATS}
  for n in range(ruler.FWE_MIN_WORDS, 3000):
    counts = ruler.zipf_counts(n)
    assert counts.sum() == n and counts.min() >= 1
    top = [*counts[1 : 2 + ruler.FWE_TOP], 0][: ruler.FWE_TOP + 1]  # ranks 2..5
    assert np.all(np.diff(top) < 0), n
  # One word shorter and the answer's counts tie somewhere: FWE_MIN_WORDS is the least length.
  counts = ruler.zipf_counts(ruler.FWE_MIN_WORDS - 1)
  top = [*counts[1 : 2 + ruler.FWE_TOP], 0, 0, 0][: ruler.FWE_TOP + 1]
  assert not np.all(np.diff(top) < 0)


@pytest.mark.parametrize("task", RULER)
def test_generation_is_a_function_of_the_seed(task):
  n = synthetic.min_length(task) + 10
  a = [synthetic.generate(task, np.random.default_rng(7), n) for _ in range(2)]
  b = synthetic.generate(task, np.random.default_rng(8), n)
  np.testing.assert_array_equal(a[0][0], a[1][0])
  np.testing.assert_array_equal(a[0][1], a[1][1])
  assert not np.array_equal(a[0][0], b[0])


# ---- Validation and training batches ----


@pytest.mark.parametrize(
  ("task", "n", "match"),
  [
    ("common_words", 18, "common_words needs task length >= 19, got 18"),
    ("frequent_words", ruler.FWE_MIN_WORDS - 1, "frequent_words needs task length >= 53"),
    ("common_words", 20000, "17576 distinct 3-letter words: task length 20000 is too long"),
  ],
)
def test_lengths_a_task_cannot_generate_are_refused(task, n, match):
  with pytest.raises(DataError, match=match):
    synthetic.generate(task, np.random.default_rng(0), n)


def test_a_training_range_below_a_tasks_minimum_names_the_field():
  cfg = DataConfig(
    source="synthetic", task="frequent_words", task_min_len=8, task_max_len=64, seq_len=300
  )
  with pytest.raises(DataError, match=r"data.task_min_len=8: frequent_words needs"):
    synthetic.check_config(cfg)


@pytest.mark.parametrize("task", RULER)
def test_training_batches_weight_exactly_the_answer(task):
  low = synthetic.min_length(task)
  seq_len = synthetic.example_length(task, low + 8) - 1
  cfg = DataConfig(
    source="synthetic", task=task, task_min_len=low, task_max_len=low + 8, seq_len=seq_len
  )
  batch = synthetic.SyntheticBatches(cfg, global_batch_size=4, seed=0).batch(3)
  for row in range(4):
    t = int(batch["segment_ids"][row].sum())
    # The example is the inputs and the last target; the weighted targets are its last tokens,
    # the answer, which the solver finds from the tokens before them.
    full = text(batch["inputs"][row, :t]) + text(batch["targets"][row, t - 1 : t])
    answer = text(batch["targets"][row][batch["weights"][row] == 1])
    prompt = full[: len(full) - len(answer)]
    assert full.endswith(answer) and solve(task, prompt) == answer
    assert batch["weights"][row].nonzero()[0].tolist() == list(range(len(prompt) - 1, t))
