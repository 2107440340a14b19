"""Tests of roformer.randomized_positions."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer.randomized_positions import randomize_positions


def _draw(positions, step, seed=0, max_position=64):
  return np.asarray(
    randomize_positions(
      jnp.asarray(positions, jnp.int32), max_position=max_position, seed=seed, step=step
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


def test_packed_documents_map_to_increasing_prefixes_of_one_subset():
  pos = np.array([[0, 1, 2, 3, 0, 1, 2, 0]])
  got = _draw(pos, step=0)[0]
  full = _draw(np.arange(8)[None], step=0)[0]
  np.testing.assert_array_equal(got, full[pos[0]])


def test_uniform_over_the_range():
  # Every position of [0, 16) is about equally likely over many rows (each row takes 8 of 16).
  got = _draw(np.tile(np.arange(8), (4000, 1)), step=0, max_position=16)
  counts = np.bincount(got.ravel(), minlength=16) / 4000
  np.testing.assert_allclose(counts, 0.5, atol=0.04)


def test_a_range_shorter_than_the_sequence_is_refused():
  with pytest.raises(ValueError, match="posenc.randomize_max=4 must be >= the sequence length 8"):
    _draw(np.arange(8)[None], step=0, max_position=4)


def test_config_refuses_a_range_shorter_than_the_training_length():
  from configs import default
  from roformer import config_lib

  config = default.get_config()
  config.posenc.randomize_max = 100  # data.seq_len is 512
  with pytest.raises(config_lib.ConfigError, match="posenc.randomize_max=100 must be 0 .* >= "):
    config_lib.run_config_from_dict(config)
