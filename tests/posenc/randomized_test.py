"""Tests of roformer.randomized_positions."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer.posenc import randomized as rp


def _draw(positions, segment_ids=None, *, step=0, seed=0, max_position=64):
  return np.asarray(
    rp.randomize_positions(
      jnp.asarray(positions, jnp.int32),
      None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32),
      max_position=max_position,
      key=rp.train_key(seed, step),
    )
  )


def test_positions_are_sorted_distinct_subsets_of_the_range():
  pos = np.tile(np.arange(16), (4, 1))
  got = _draw(pos, step=3)
  assert got.shape == (4, 16) and got.min() >= 0 and got.max() < 64
  assert np.all(np.diff(got, axis=1) > 0)
  assert len({tuple(r) for r in got}) == 4  # rows draw different subsets
  assert got.max() > 32  # they reach far past the sequence length


def test_positions_are_a_function_of_seed_and_step():
  pos = np.tile(np.arange(16), (2, 1))
  np.testing.assert_array_equal(_draw(pos, step=5), _draw(pos, step=5))
  assert not np.array_equal(_draw(pos, step=5), _draw(pos, step=6))
  assert not np.array_equal(_draw(pos, step=5), _draw(pos, step=5, seed=1))


def test_a_short_example_spans_the_whole_range():
  # A 9-token example padded to 64 (segment 1, then padding 0): its positions are a 9-subset of
  # [0, 512), not the 9 smallest of a 64-subset (which would end near 512 * 9 / 64 = 72).
  L, N, rows = 64, 512, 2000
  seg = np.zeros((rows, L), np.int32)
  seg[:, :9] = 1
  got = _draw(np.tile(np.arange(L), (rows, 1)), seg, max_position=N)
  example = got[:, :9]
  assert np.all(np.diff(example, axis=1) > 0)
  # The largest of 9 uniform draws from [0, N) has mean N * 9 / 10 = 461.
  assert 440 < example[:, -1].mean() < 480
  assert 30 < example[:, 0].mean() < 70  # the smallest: N / 10 = 51
  pad = got[:, 9:]
  assert np.all(np.diff(pad, axis=1) > 0) and pad.max() < N


def test_packed_documents_each_span_the_range_with_their_own_length():
  seg = np.array([[1] * 5 + [2] * 3 + [3] * 6 + [0] * 2] * 3000)
  pos = np.array([list(range(5)) + list(range(3)) + list(range(6)) + [0, 0]] * 3000)
  got = _draw(pos, seg, max_position=40)
  for doc_ids, k in ((1, 5), (2, 3), (3, 6)):
    doc = got[seg == doc_ids].reshape(3000, k)
    assert np.all(np.diff(doc, axis=1) > 0)
    # The largest of k of 40: mean 41 k / (k + 1) - 1.
    np.testing.assert_allclose(doc[:, -1].mean(), 41 * k / (k + 1) - 1, atol=0.6)
  # Documents of one row never share a position (disjoint parts of one draw).
  assert all(len(set(r[:14])) == 14 for r in got[:50])


def test_uniform_over_the_range():
  # Every position of [0, 16) is about equally likely over many rows (each row takes 8 of 16).
  got = _draw(np.tile(np.arange(8), (4000, 1)), max_position=16)
  counts = np.bincount(got.ravel(), minlength=16) / 4000
  np.testing.assert_allclose(counts, 0.5, atol=0.04)


def test_evaluation_keys_differ_by_draw_and_length():
  pos = jnp.tile(jnp.arange(8), (1, 1))

  def draw(d, n):
    return np.asarray(rp.randomize_positions(pos, None, max_position=64, key=rp.eval_key(0, d, n)))

  np.testing.assert_array_equal(draw(0, 8), draw(0, 8))
  assert not np.array_equal(draw(0, 8), draw(1, 8))
  assert not np.array_equal(draw(0, 8), draw(0, 9))
  # Evaluation never reuses a training step's draw.
  train = _draw(np.arange(8)[None], step=0)
  assert not np.array_equal(draw(0, 8), train)


def test_protocol_record():
  assert rp.protocol(0) == {"kind": "consecutive"}
  assert rp.protocol(256, 4) == {"kind": "randomized", "max_position": 256, "draws": 4}


def test_a_range_shorter_than_the_sequence_is_refused():
  with pytest.raises(ValueError, match="posenc.randomize_max=4 must be >= the sequence length 8"):
    _draw(np.arange(8)[None], max_position=4)


def test_config_refuses_a_range_shorter_than_the_training_length():
  from configs import default
  from roformer import config as config_lib

  config = default.get_config()
  config.posenc.randomize_max = 100  # data.seq_len is 512
  with pytest.raises(config_lib.ConfigError, match="posenc.randomize_max=100 must be 0 .* >= "):
    config_lib.run_config_from_dict(config)
