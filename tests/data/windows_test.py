"""Tests of the evaluation windows: the same targets at every length, each scored once."""

import logging

import numpy as np
import pytest

from roformer import data

MAX_LENGTH = 64
TOKENS = np.arange(10_000, dtype=np.int32)  # token value == index, so targets name themselves


def _scored(windows):
  return np.sort(windows.target_indices[windows.weights == 1])


@pytest.mark.parametrize("length", [8, 16, 24, 48, 64])
@pytest.mark.parametrize(
  ("protocol", "stride"), [("nonoverlapping", "length"), ("sliding", "quarter"), ("sliding", 5)]
)
def test_eval_windows_score_the_same_span_exactly_once(length, protocol, stride):
  stride = {"length": length, "quarter": max(1, length // 4)}.get(stride, stride)
  w = data.eval_windows(
    TOKENS,
    length=length,
    protocol=protocol,
    stride=min(stride, length),
    max_tokens=300,
    max_length=MAX_LENGTH,
  )
  # 300 rounds down to 256 targets, starting after a 64-token prefix.
  assert w.num_tokens == 256 == w.weights.sum()
  np.testing.assert_array_equal(_scored(w), np.arange(MAX_LENGTH, MAX_LENGTH + 256))
  assert w.inputs.shape == w.targets.shape == w.positions.shape == (len(w.inputs), length)
  np.testing.assert_array_equal(w.targets, w.target_indices)
  np.testing.assert_array_equal(w.inputs, w.targets - 1)  # next-token prediction
  np.testing.assert_array_equal(w.positions, np.broadcast_to(np.arange(length), w.inputs.shape))
  np.testing.assert_array_equal(np.diff(w.target_indices, axis=1), 1)  # contiguous windows


def test_eval_windows_sliding_scores_only_tokens_with_long_context():
  w = data.eval_windows(
    TOKENS, length=64, protocol="sliding", stride=16, max_tokens=256, max_length=64
  )
  assert np.all(w.positions[w.weights == 1] >= 64 - 16)
  assert len(w.inputs) == 256 // 16
  np.testing.assert_array_equal(w.target_indices[:, -1], 64 + 16 * np.arange(1, 17) - 1)


def test_eval_windows_sliding_with_stride_equal_to_length_is_nonoverlapping():
  for length in (16, 48):
    kw = dict(length=length, stride=length, max_tokens=512, max_length=64)
    a = data.eval_windows(TOKENS, protocol="nonoverlapping", **kw)
    b = data.eval_windows(TOKENS, protocol="sliding", **kw)
    for field in ("inputs", "targets", "positions", "weights", "target_indices"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_eval_windows_last_window_shifts_back_and_scores_only_new_targets():
  w = data.eval_windows(
    TOKENS, length=48, protocol="nonoverlapping", stride=48, max_tokens=128, max_length=64
  )
  # 128 targets = 2 full windows of 48 + 32 more, scored by a window shifted back by 16.
  assert len(w.inputs) == 3
  assert w.target_indices[-1, -1] == 64 + 128 - 1
  np.testing.assert_array_equal(w.weights[-1], np.arange(48) >= 16)


def test_eval_windows_short_split_shrinks_span_with_warning(caplog):
  tokens = TOKENS[:300]
  with caplog.at_level(logging.WARNING, logger="roformer.data"):
    w = data.eval_windows(
      tokens, length=32, protocol="nonoverlapping", stride=32, max_tokens=65536, max_length=64
    )
  assert w.num_tokens == 192  # (300 - 64) rounded down to a multiple of 64
  assert "192" in caplog.text and "65536" in caplog.text
  np.testing.assert_array_equal(_scored(w), np.arange(64, 256))


@pytest.mark.parametrize(
  ("kwargs", "pattern"),
  [
    (dict(tokens=TOKENS[:127]), "max_length=64 needs 128 tokens.*127"),
    (dict(protocol="strided"), "protocol='strided'.*nonoverlapping, sliding"),
    (dict(length=65), "length=65"),
    (dict(protocol="sliding", stride=0), "stride=0"),
    (dict(protocol="sliding", stride=40), "stride=40"),
  ],
)
def test_eval_windows_bad_arguments_raise_data_error(kwargs, pattern):
  args = dict(
    tokens=TOKENS, length=32, protocol="nonoverlapping", stride=32, max_tokens=256, max_length=64
  )
  args.update(kwargs)
  with pytest.raises(data.DataError, match=pattern):
    data.eval_windows(args.pop("tokens"), **args)
