"""RULER's synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654) at byte scale, as `data.task`
kinds; synthetic.py's registry imports them.

Each task follows RULER's generator (NVIDIA/RULER, scripts/data/synthetic/niah.py,
variable_tracking.py, common_words_extraction.py, freq_words_extraction.py) with the sizes of
the configuration RULER reports (scripts/synthetic.yaml), scaled to a byte vocabulary and short
contexts. The task length n (`data.task_min_len`..`data.task_max_len` in training, any n at
evaluation) counts:

  niah_multikey     n filler tokens with NIAH_KEYS needles `KEY=DDDDD.` hidden at random
                    offsets (KEY 3 capital letters, distinct; DDDDD 5 digits), then `?KEY=` for
                    one of them and its 5 digits. The other needles are the distractors.
                    RULER's niah_multikey_1: 4 keys, one queried.
  niah_multivalue   n filler tokens with NIAH_VALUES needles `KEY=DDDDD.` of one key (distinct
                    values), then `?KEY=` and every value in the order of the text, joined by
                    `,`. RULER's niah_multivalue: 4 values, all must be returned.
  variable_tracking n filler tokens with VT_CHAINS chains of VT_HOPS + 1 assignments
                    `X1=DDDDD.`, `X2=X1.`, ..., `X5=X4.` (names 3 capital letters, distinct)
                    at random offsets, each chain in order, the chains interleaved; then
                    `?DDDDD:` for the value of one chain and that chain's variables in order,
                    joined by `,`. RULER's vt: 4 hops, "return every variable assigned the value".
  common_words      a list of n words (3 lowercase letters each, joined by spaces):
                    CWE_COMMON words repeated CWE_COMMON_REPEATS times, the other
                    n - CWE_COMMON * CWE_COMMON_REPEATS words once each, shuffled; then
                    `?common=` and the common words in the order of their first appearance,
                    joined by `,`. n >= CWE_MIN_WORDS. RULER's cwe (its setting for contexts
                    under 4K: common words 6 times, the others once).
  frequent_words    a list of n words: word k of a random vocabulary appears
                    floor(n k^-alpha / zeta(alpha)) times (alpha = FWE_ALPHA, Zipf), word 1 being
                    the noise word `...` that also takes the rounding remainder (so the list
                    has exactly n words); shuffled, joined by spaces; then `?frequent=` and the
                    FWE_TOP most frequent words but the noise, most frequent first, joined by
                    `,`. n >= FWE_MIN_WORDS, where those counts are strictly decreasing (each
                    answer word has a rank). RULER's fwe: alpha 2, top 3, the top word `....`
                    excluded.

Where these differ from RULER, and why:
- Tokens are bytes; keys, values and words are short (3 letters, 5 digits) so that a needle costs
  10 tokens, not RULER's 7-digit numbers, adjective-noun keys and English words of a BPE
  vocabulary. Common and frequent words are random 3-letter strings (RULER: English words for
  cwe, random 6-letter strings for fwe), so nothing is known about a word but its count.
- The haystack is the passkey filler (RULER's "noise" haystack), never essays, and needles go at
  uniformly random byte offsets (as passkey's key does), not between sentences at 40 depths.
- variable_tracking has 2 chains, not RULER's 1: with one chain the answer is every variable in
  the text and the query value is never needed; a second chain makes the model follow the value.
- common_words asks for 3 words, not 10, and its list is not numbered ("1. word 2. word ..."):
  numbering would triple a byte-level list. Answers are scored by exact match and per-token
  accuracy in a fixed order (RULER's string_match_all counts each reference word found anywhere
  in the output, in any order): values and variables in the order of the text, common words in
  the order of first appearance, frequent words by frequency.
- No instructions or few-shot examples: a model is trained on the task, and the query marker
  says which task it is.
- Lengths are exact: an example's length is a function of n alone (`example_length`), where
  RULER fills a token budget by binary search over the haystack size.
"""

from __future__ import annotations

import math

import numpy as np

from roformer.data.task_text import example, filler, ids
from roformer.errors import DataError

TASKS = ("niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "frequent_words")

NAME_LETTERS = 3  # capital letters of a needle key or a variable name
VALUE_DIGITS = 5  # digits of a needle value or a chain's value (RULER: 7)
WORD_LETTERS = 3  # lowercase letters of a common/frequent word
NIAH_KEYS = 4  # niah_multikey: needles, one queried, the others distractors (RULER: 4)
NIAH_VALUES = 4  # niah_multivalue: values of the one key (RULER: 4)
VT_CHAINS, VT_HOPS = 2, 4  # variable_tracking (RULER: 1 chain of 4 hops)
CWE_COMMON, CWE_COMMON_REPEATS = 3, 6  # common_words (RULER under 4K: 10 words, 6 times)
CWE_MIN_WORDS = CWE_COMMON * CWE_COMMON_REPEATS + 1  # at least one uncommon word
FWE_ALPHA, FWE_TOP = 2.0, 3  # frequent_words (RULER: alpha 2, top 3)
NOISE_WORD = b"..."  # frequent_words' rank-1 word, never an answer (RULER: "....")
_NAMES = 26**NAME_LETTERS
_WORDS = 26**WORD_LETTERS
_ZETA_2 = math.pi**2 / 6


def zipf_counts(n: int, alpha: float = FWE_ALPHA) -> np.ndarray:
  """frequent_words' counts int64 [V] of a list of n words: count k (k = 1..V) is
  floor(n k^-alpha / zeta(alpha)) for k >= 2, down to the last k with a count >= 1; count 1 (the
  noise word) is what is left of n."""
  if alpha != 2.0:
    raise ValueError(f"zipf_counts has zeta(alpha) for alpha = 2 only, got {alpha}")
  counts = [0]
  while (count := int(n * (len(counts) + 1) ** -alpha / _ZETA_2)) >= 1:
    counts.append(count)
  counts[0] = n - sum(counts)
  return np.asarray(counts, np.int64)


def _fwe_min_words() -> int:
  """The smallest n from which frequent_words' answer counts are strictly decreasing for every
  longer list. Past n = 1 / (zeta(2)^-1 (1/16 - 1/25)) < 74 each of the gaps between ranks 2..5
  is at least 1 by itself (floor(x) - floor(y) >= floor(x - y)), so n < 80 is checked by hand."""

  def ranked(n):
    counts = zipf_counts(n)
    top = np.concatenate([counts[1:], np.zeros(FWE_TOP + 1, np.int64)])[: FWE_TOP + 1]
    return len(counts) > FWE_TOP and bool(np.all(np.diff(top) < 0))  # ranks 2..5 decrease

  return 1 + max(n for n in range(1, 80) if not ranked(n))


FWE_MIN_WORDS = _fwe_min_words()
MIN_LENGTH = {"common_words": CWE_MIN_WORDS, "frequent_words": FWE_MIN_WORDS}
MAX_LENGTH = {"common_words": _WORDS - CWE_COMMON + CWE_COMMON * CWE_COMMON_REPEATS}
_MIN_REASON = {
  "common_words": f"{CWE_COMMON} words x {CWE_COMMON_REPEATS} and at least one other",
  "frequent_words": "shorter Zipf lists tie the counts of the answer words",
}


def _letters(codes: np.ndarray, letters: int, first: str) -> np.ndarray:
  """Base-26 codes [k] as token ids [k, letters] of `letters` letters from `first`."""
  powers = 26 ** np.arange(letters - 1, -1, -1)
  return (ord(first) + codes[:, None] // powers % 26).astype(np.int32)


def _names(rng, k: int) -> np.ndarray:
  """k distinct names of NAME_LETTERS capital letters, int32 [k, NAME_LETTERS]."""
  return _letters(rng.choice(_NAMES, k, replace=False), NAME_LETTERS, "A")


def _words(rng, k: int) -> np.ndarray:
  """k distinct words of WORD_LETTERS lowercase letters, int32 [k, WORD_LETTERS]."""
  return _letters(rng.choice(_WORDS, k, replace=False), WORD_LETTERS, "a")


def _values(rng, k: int) -> np.ndarray:
  """k distinct numbers of VALUE_DIGITS digits (leading zeros kept), int32 [k, VALUE_DIGITS]."""
  codes = rng.choice(10**VALUE_DIGITS, k, replace=False)
  powers = 10 ** np.arange(VALUE_DIGITS - 1, -1, -1)
  return (ord("0") + codes[:, None] // powers % 10).astype(np.int32)


def _join(items, sep: bytes) -> np.ndarray:
  pieces = []
  for i, item in enumerate(items):
    pieces += [ids(sep)] if i else []
    pieces.append(np.asarray(item, np.int32))
  return np.concatenate(pieces)


def _hide(rng, n: int, pieces: list[np.ndarray]) -> np.ndarray:
  """n filler tokens with `pieces` inserted in their order at sorted uniform offsets in [0, n]."""
  haystack = filler(n)
  offsets = np.sort(rng.integers(0, n + 1, len(pieces)))
  out, done = [], 0
  for offset, piece in zip(offsets.tolist(), pieces, strict=True):
    out += [haystack[done:offset], piece]
    done = offset
  return np.concatenate([*out, haystack[done:]])


def _needle(key: np.ndarray, value: np.ndarray) -> np.ndarray:
  return np.concatenate([key, ids(b"="), value, ids(b".")])


def _niah_multikey(rng, n, **_):
  keys, values = _names(rng, NIAH_KEYS), _values(rng, NIAH_KEYS)
  haystack = _hide(rng, n, [_needle(k, v) for k, v in zip(keys, values, strict=True)])
  q = int(rng.integers(NIAH_KEYS))
  return example([haystack, ids(b"?"), keys[q], ids(b"=")], values[q])


def _niah_multivalue(rng, n, **_):
  key, values = _names(rng, 1)[0], _values(rng, NIAH_VALUES)
  haystack = _hide(rng, n, [_needle(key, v) for v in values])
  return example([haystack, ids(b"?"), key, ids(b"=")], _join(values, b","))


def _variable_tracking(rng, n, **_):
  names = _names(rng, VT_CHAINS * (VT_HOPS + 1)).reshape(VT_CHAINS, VT_HOPS + 1, NAME_LETTERS)
  values = _values(rng, VT_CHAINS)
  chains = [
    [_needle(chain[0], value)] + [_needle(chain[h + 1], chain[h]) for h in range(VT_HOPS)]
    for chain, value in zip(names, values, strict=True)
  ]
  # A random interleaving that keeps each chain in order: slot i takes its chain's next line.
  order = rng.permutation(np.repeat(np.arange(VT_CHAINS), VT_HOPS + 1))
  lines = [chains[c].pop(0) for c in order.tolist()]
  haystack = _hide(rng, n, lines)
  q = int(rng.integers(VT_CHAINS))
  return example([haystack, ids(b"?"), values[q], ids(b":")], _join(names[q], b","))


def _common_words(rng, n, **_):
  words = _words(rng, n - CWE_COMMON * (CWE_COMMON_REPEATS - 1))  # the common ones first
  repeats = np.where(np.arange(len(words)) < CWE_COMMON, CWE_COMMON_REPEATS, 1)
  listed = rng.permutation(np.repeat(np.arange(len(words)), repeats))
  first_seen = [w for w in dict.fromkeys(listed.tolist()) if w < CWE_COMMON]
  return example([_join(words[listed], b" "), ids(b"?common=")], _join(words[first_seen], b","))


def _frequent_words(rng, n, **_):
  counts = zipf_counts(n)
  words = np.concatenate([ids(NOISE_WORD)[None], _words(rng, len(counts) - 1)])
  listed = rng.permutation(np.repeat(np.arange(len(counts)), counts))
  return example(
    [_join(words[listed], b" "), ids(b"?frequent=")], _join(words[1 : 1 + FWE_TOP], b",")
  )


GENERATORS = {
  "niah_multikey": _niah_multikey,
  "niah_multivalue": _niah_multivalue,
  "variable_tracking": _variable_tracking,
  "common_words": _common_words,
  "frequent_words": _frequent_words,
}


def example_length(task: str, n: int) -> int:
  """Tokens in an example of task length n (its model input is one token shorter)."""
  needle = NAME_LETTERS + VALUE_DIGITS + 2  # KEY=DDDDD.
  query = 1 + NAME_LETTERS + 1  # ?KEY=
  if task == "niah_multikey":
    return n + NIAH_KEYS * needle + query + VALUE_DIGITS
  if task == "niah_multivalue":
    return n + NIAH_VALUES * needle + query + NIAH_VALUES * (VALUE_DIGITS + 1) - 1
  if task == "variable_tracking":
    hop = 2 * NAME_LETTERS + 2  # X2=X1.
    answer = (VT_HOPS + 1) * (NAME_LETTERS + 1) - 1
    return n + VT_CHAINS * (needle + VT_HOPS * hop) + VALUE_DIGITS + 2 + answer
  listed = n * (WORD_LETTERS + 1) - 1
  if task == "common_words":
    return listed + len(b"?common=") + CWE_COMMON * (WORD_LETTERS + 1) - 1
  return listed + len(b"?frequent=") + FWE_TOP * (WORD_LETTERS + 1) - 1  # frequent_words


def check_length(task: str, n: int) -> None:
  """Raises DataError when task length n is outside what `task` can generate."""
  if n < MIN_LENGTH.get(task, 1):
    raise DataError(
      f"{task} needs task length >= {MIN_LENGTH[task]}, got {n} ({_MIN_REASON[task]})"
    )
  if task in MAX_LENGTH and n > MAX_LENGTH[task]:
    raise DataError(
      f"{task} has {_WORDS} distinct {WORD_LETTERS}-letter words: task length {n} is too long "
      f"(at most {MAX_LENGTH[task]})"
    )
