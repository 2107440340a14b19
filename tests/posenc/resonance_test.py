"""Tests of Resonance RoPE (posenc.rope_resonance) against hand computations."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from roformer import posenc, testing
from roformer.posenc.config import PosEncConfig, RopeScaling
from roformer.posenc.resonance import resonance_frequencies


def test_wavelengths_round_to_integers_and_frequencies_follow():
  # d = 8, base 10^4: theta = 1, 0.1, 0.01, 0.001; 2 pi / theta = 6.28, 62.8, 628.3, 6283.2.
  got = resonance_frequencies(jnp.asarray([1.0, 0.1, 0.01, 0.001], jnp.float32))
  want = [2 * math.pi / w for w in (6, 63, 628, 6283)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def _inv_freq(**fields):
  rope = testing.build_posenc("rope", num_heads=2, head_dim=8, **fields)
  return np.asarray(rope.prepare(testing.arange_positions(1, 4)).inv_freq, np.float64)


def test_resonance_yarn_rounds_the_wavelengths_yarn_produced():
  yarn = RopeScaling(kind="yarn", factor=4.0, original_max_len=64)
  plain_yarn = _inv_freq(scaling=yarn)
  by_hand = 2 * math.pi / np.round(2 * math.pi / plain_yarn)
  np.testing.assert_allclose(_inv_freq(scaling=yarn, rope_resonance=True), by_hand, rtol=1e-6)
  assert not np.allclose(plain_yarn, by_hand, rtol=1e-4)  # rounding changed them
  # YaRN's attention factor is untouched.
  rope = testing.build_posenc("rope", num_heads=2, head_dim=8, scaling=yarn, rope_resonance=True)
  assert rope.prepare(testing.arange_positions(1, 4)).attention_factor == pytest.approx(
    0.1 * math.log(4.0) + 1
  )


def test_resonance_pairs_repeat_every_whole_wavelength():
  # Pair 1 (dims 2, 3; theta = 10000^(-2/4) = 0.01): wavelength 628.3 -> 628 positions.
  rotations = {}
  for resonance in (True, False):
    rope = testing.build_posenc("rope", num_heads=1, head_dim=4, rope_resonance=resonance)
    q = jnp.ones((1, 2, 1, 4))
    pos = jnp.asarray([[3, 3 + 628 * 5]])
    q_rot, _ = rope.rotate(q, q, pos, pos)
    rotations[resonance] = np.asarray(q_rot)[0, :, 0, 2:]
  np.testing.assert_allclose(rotations[True][0], rotations[True][1], atol=1e-4)
  assert not np.allclose(rotations[False][0], rotations[False][1], atol=1e-2)


def test_resonance_of_a_non_rotary_encoding_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="posenc.rope_resonance"):
    posenc.validate_posenc(PosEncConfig(kind="alibi", rope_resonance=True), causal=True,
                           head_dim=8)  # fmt: skip


def test_resonance_yarn_of_the_authors_from_scratch_code_matches_a_hand_computation():
  # Their YaRN gets the extended length E = 512 as max_position_embeddings, beta_fast 2 and
  # beta_slow 1: d = 8, base 10^4, theta = 1, 0.1, 0.01, 0.001, factor 4.
  # correction dim of r rotations: 8 ln(512 / (2 pi r)) / (2 ln 10^4): r = 2 -> 1.61, floored to
  # 1; r = 1 -> 1.91, ceiled to 2. Pairs 0 and 1 keep theta, pairs 2 and 3 take theta / 4.
  authors = RopeScaling(
    kind="yarn", factor=4.0, original_max_len=128, beta_fast=2.0, beta_slow=1.0, ramp_len=512
  )
  by_hand = np.asarray([1.0, 0.1, 0.0025, 0.00025])
  np.testing.assert_allclose(_inv_freq(scaling=authors), by_hand, rtol=1e-6)
  # Resonance rounds those: wavelengths 6.28, 62.8, 2513.3, 25132.7 -> 6, 63, 2513, 25133.
  rounded = [2 * math.pi / w for w in (6, 63, 2513, 25133)]
  np.testing.assert_allclose(_inv_freq(scaling=authors, rope_resonance=True), rounded, rtol=1e-6)
  # Negative control: Hugging Face's ramp (beta_fast 32 over L0 = 128: dims 0 to 2) interpolates
  # pair 1 half-way: 0.1 / 4 / 2 + 0.1 / 2 = 0.0625.
  hf = _inv_freq(scaling=RopeScaling(kind="yarn", factor=4.0, original_max_len=128))
  np.testing.assert_allclose(hf, [1.0, 0.0625, 0.0025, 0.00025], rtol=1e-6)


def test_a_ramp_length_is_refused_by_a_scaling_that_does_not_read_it():
  from roformer.posenc import rope_scaling

  with pytest.raises(ValueError, match="ramp_len=512 is read by .* not by 'linear'"):
    rope_scaling.check_scaling(RopeScaling(kind="linear", factor=2.0, ramp_len=512))
  with pytest.raises(ValueError, match="ramp_len=-1 must be >= 0"):
    rope_scaling.check_scaling(
      RopeScaling(kind="yarn", factor=2.0, original_max_len=64, ramp_len=-1)
    )
  read = RopeScaling(kind="yarn", factor=2.0, original_max_len=64, ramp_len=512)
  rope_scaling.check_scaling(read)  # no error
