"""Tests of the evaluation windows: the same targets at every length, each scored once; the
encoder's masked windows."""

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
    (dict(model_kind="seq2seq"), "model.kind='seq2seq'.*decoder, encoder"),
  ],
)
def test_eval_windows_bad_arguments_raise_data_error(kwargs, pattern):
  args = dict(
    tokens=TOKENS, length=32, protocol="nonoverlapping", stride=32, max_tokens=256, max_length=64
  )
  args.update(kwargs)
  with pytest.raises(data.DataError, match=pattern):
    data.eval_windows(args.pop("tokens"), **args)


def _text_tokens(n=700, seed=0):
  # Byte-like text with EOS separators, so the encoder's special-token rule is exercised.
  tokens = np.random.default_rng(seed).integers(32, 127, n).astype(np.int32)
  tokens[::50] = data.ByteTokenizer.eos_id
  return tokens


@pytest.mark.parametrize("model_kind", ["decoder", "encoder"])
def test_eval_windows_every_length_and_protocol_scores_the_same_tokens(model_kind):
  tokens = _text_tokens()
  scored = set()
  for length in (8, 16, 32, 64):
    for protocol, stride in (("nonoverlapping", length), ("sliding", max(1, length // 4))):
      w = data.eval_windows(
        tokens,
        model_kind=model_kind,
        length=length,
        protocol=protocol,
        stride=stride,
        max_tokens=256,
        max_length=64,
        tokenizer=data.ByteTokenizer(),
      )
      # Every scored (window, slot) names its target; the multiset must not depend on the length.
      targets = tuple(sorted(w.targets[w.weights > 0].tolist()))
      scored.add((w.num_tokens, float(w.weights.sum()), targets))
  assert len(scored) == 1
  num_tokens = scored.pop()[0]
  assert num_tokens == (256 if model_kind == "decoder" else pytest.approx(0.15 * 256, abs=20))


def test_eval_windows_encoder_masks_inputs_only_where_scored_targets_differ():
  tokens = _text_tokens()
  w = data.eval_windows(
    tokens,
    model_kind="encoder",
    length=32,
    protocol="nonoverlapping",
    stride=32,
    max_tokens=256,
    max_length=64,
    tokenizer=data.ByteTokenizer(),
  )
  changed = w.inputs != w.targets
  assert changed.any()
  # Corrupted inputs occur only at masked positions; most of those hold the mask token.
  assert (w.weights[changed] > 0).all()
  assert (w.inputs[changed] == data.ByteTokenizer.mask_id).mean() > 0.6
  assert not ((w.weights > 0) & (w.targets == data.ByteTokenizer.eos_id)).any()
  # Targets are the window's own tokens, at consecutive positions of the stream.
  np.testing.assert_array_equal(w.targets[0], tokens[64:96])


@pytest.mark.parametrize("model_kind", ["decoder", "encoder"])
@pytest.mark.parametrize(("length", "stride"), [(64, 21), (64, 63), (48, 17), (64, 1)])
def test_eval_windows_strides_that_do_not_divide_the_span_stay_inside_the_split(
  model_kind, length, stride
):
  # 64 targets in strides of 21 leave a last window with 1 target: centred on it, an encoder's
  # window would read past the right context kept after the span.
  tokens = _text_tokens(n=64 + 64 + 32)  # prefix, span, the right context and nothing more
  w = data.eval_windows(
    tokens,
    model_kind=model_kind,
    length=length,
    protocol="sliding",
    stride=stride,
    max_tokens=100,
    max_length=64,
    tokenizer=data.ByteTokenizer(),
  )
  assert w.target_indices.max() < len(tokens)
  scored = np.sort(w.target_indices[w.weights > 0])
  assert len(scored) == len(np.unique(scored))  # each target scored once
  assert scored.min() >= 64 and scored.max() < 128  # inside the span
  if model_kind == "decoder":
    np.testing.assert_array_equal(scored, np.arange(64, 128))
