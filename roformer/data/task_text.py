"""Byte-level text of the synthetic tasks: token ids of text, an example from its prompt and
answer, and the filler text that tasks hide things in (synthetic.py and ruler.py share these)."""

from __future__ import annotations

import numpy as np

# The filler sentences of the passkey paper (Mohtashami & Jaggi 2023), which RULER also uses as
# its "noise" haystack.
FILLER = (
  b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def ids(text: bytes) -> np.ndarray:
  """Token ids int32 [len(text)] of bytes (the `bytes` tokenizer: id b for byte b)."""
  return np.frombuffer(text, np.uint8).astype(np.int32)


def filler(n: int) -> np.ndarray:
  """The first n tokens of FILLER repeated, int32 [n]."""
  return ids(FILLER * (n // len(FILLER) + 1))[:n]


def example(prompt: list[np.ndarray], answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [T], is_answer bool [T]): the prompt's pieces, then the answer, marked."""
  tokens = np.concatenate([*prompt, answer]).astype(np.int32)
  is_answer = np.zeros(len(tokens), bool)
  is_answer[len(tokens) - len(answer) :] = True
  return tokens, is_answer
