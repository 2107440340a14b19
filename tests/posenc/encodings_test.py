"""Tests of roformer.posenc: defining properties, golden values and Hugging Face parity fixtures."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import posenc, testing
from roformer.posenc import POSENCS, PosEnc
from roformer.posenc.config import PosEncConfig, RopeScaling

FIXTURES = testing.FIXTURES
with open(os.path.join(FIXTURES, "rope_hf.json")) as _f:
  ROPE_HF = json.load(_f)
with open(os.path.join(FIXTURES, "t5_buckets.json")) as _f:
  T5_BUCKETS = json.load(_f)


make = testing.build_posenc


def normal(seed, shape, dtype=jnp.float32):
  # numpy draws: jax.random would compile a new kernel for every shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)).astype(dtype)


# One compiled program per encoding and shape, instead of one per primitive in eager mode.
@jax.jit
def rotate(pe, q, k, qpos, kpos):
  return pe.rotate(q, k, qpos, kpos)


@jax.jit
def bias(pe, qpos, kpos):
  return pe.bias(qpos, kpos)


@jax.jit
def embed(pe, x, pos):
  return pe.embed(x, pos)


def scores_BHLS(q_BLHK, k_BSHK):
  return jnp.einsum(
    "blhk,bshk->bhls", q_BLHK.astype(jnp.float32), k_BSHK.astype(jnp.float32), precision="highest"
  )


def shifted_scores(pe, q_LHK, k_SHK, qpos_L, kpos_S, shifts):
  """Scores of the same q, k with every position shifted by each of `shifts` (one row each)."""
  shifts_B1 = jnp.asarray(shifts, jnp.int32)[:, None]
  B = shifts_B1.shape[0]
  qpos_BL = jnp.asarray(qpos_L, jnp.int32)[None, :] + shifts_B1
  kpos_BS = jnp.asarray(kpos_S, jnp.int32)[None, :] + shifts_B1
  q_BLHK = jnp.broadcast_to(q_LHK[None], (B, *q_LHK.shape))
  k_BSHK = jnp.broadcast_to(k_SHK[None], (B, *k_SHK.shape))
  return scores_BHLS(*rotate(pe, q_BLHK, k_BSHK, qpos_BL, kpos_BS))


# ---- RoPE: defining properties ----


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("rope_fraction", [1.0, 0.5])
def test_rope_scores_depend_only_on_relative_offset(layout, rope_fraction):
  pe = make("rope", rope_layout=layout, rope_fraction=rope_fraction)
  q_LHK, k_SHK = normal(0, (6, 4, 16)), normal(1, (6, 4, 16))
  pos = [0, 1, 3, 7, 20, 50]
  s_BHLS = shifted_scores(pe, q_LHK, k_SHK, pos, pos, shifts=[0, 1, 17, 1000, 4096])
  np.testing.assert_allclose(s_BHLS[1:], jnp.broadcast_to(s_BHLS[:1], s_BHLS[1:].shape), atol=2e-3)
  # Positions matter at all: the same pair of vectors scores differently at another offset.
  plain_HLS = jnp.einsum("lhk,shk->hls", q_LHK, k_SHK)
  assert float(jnp.max(jnp.abs(s_BHLS[0] - plain_HLS))) > 0.5


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_preserves_norms(layout):
  pe = make("rope", rope_layout=layout)
  q, k = normal(0, (2, 5, 4, 16)), normal(1, (2, 5, 4, 16))
  pos = jnp.array([[0, 3, 99, 1000, 12345], [5, 6, 7, 8, 9]], jnp.int32)
  q2, k2 = rotate(pe, q, k, pos, pos)
  np.testing.assert_allclose(jnp.linalg.norm(q2, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(k2, axis=-1), jnp.linalg.norm(k, axis=-1), rtol=1e-5)
  assert float(jnp.max(jnp.abs(q2 - q))) > 0.5


@pytest.mark.parametrize("rope_fraction", [1.0, 0.5])
def test_rope_layouts_agree_after_permuting_pairs(rope_fraction):
  head_dim = 16
  d = posenc.rotary_dims(head_dim, rope_fraction)
  # Interleaved pair (2i, 2i+1) is half-split pair (i, i + d/2).
  perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2), np.arange(d, head_dim)])
  q, k = normal(0, (1, 6, 4, head_dim)), normal(1, (1, 6, 4, head_dim))
  pos = jnp.array([[0, 2, 5, 11, 300, 4000]], jnp.int32)
  inter = make("rope", rope_layout="interleaved", rope_fraction=rope_fraction)
  half = make("rope", rope_layout="half", rope_fraction=rope_fraction)
  qi, ki = rotate(inter, q, k, pos, pos)
  qh, kh = rotate(half, q[..., perm], k[..., perm], pos, pos)
  np.testing.assert_allclose(qh, qi[..., perm], atol=1e-5)
  np.testing.assert_allclose(scores_BHLS(qh, kh), scores_BHLS(qi, ki), atol=1e-4)
  # Without the permutation the layouts disagree (a silent corruption the test must catch).
  qh_wrong, kh_wrong = rotate(half, q, k, pos, pos)
  assert float(jnp.max(jnp.abs(scores_BHLS(qh_wrong, kh_wrong) - scores_BHLS(qi, ki)))) > 0.5


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_rotation_matches_hf_goldens(layout):
  gold = ROPE_HF["rotation"]
  q, k = jnp.array(gold["q"], jnp.float32), jnp.array(gold["k"], jnp.float32)
  pos = jnp.array(gold["positions"], jnp.int32)
  pe = make("rope", rope_layout=layout, num_heads=q.shape[2], head_dim=q.shape[3])
  q2, k2 = rotate(pe, q, k, pos, pos)
  # float32 angles at positions up to 1535 differ from HF's by ~1e-4 rad.
  np.testing.assert_allclose(q2, np.array(gold[layout]["q"]), atol=2e-4)
  np.testing.assert_allclose(k2, np.array(gold[layout]["k"]), atol=2e-4)


def test_rope_bfloat16_inputs_use_float32_angles_at_large_positions():
  head_dim = 32
  pe = make("rope", head_dim=head_dim)
  q = normal(0, (1, 8, 2, head_dim), jnp.bfloat16)
  k = normal(1, (1, 8, 2, head_dim), jnp.bfloat16)
  pos = 65536 + jnp.arange(8, dtype=jnp.int32)[None, :]
  q2, k2 = rotate(pe, q, k, pos, pos)
  assert q2.dtype == jnp.bfloat16 and k2.dtype == jnp.bfloat16

  # Reference: exact (float64) angles applied to the same bf16 inputs.
  theta = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
  angle = np.asarray(pos, np.float64)[0, :, None, None] * theta
  x = np.asarray(q.astype(jnp.float32), np.float64)[0].reshape(8, 2, head_dim // 2, 2)
  ref = np.stack(
    [
      x[..., 0] * np.cos(angle) - x[..., 1] * np.sin(angle),
      x[..., 1] * np.cos(angle) + x[..., 0] * np.sin(angle),
    ],
    axis=-1,
  ).reshape(8, 2, head_dim)
  got = np.asarray(q2.astype(jnp.float32))[0]
  np.testing.assert_allclose(got, ref, atol=3e-2, rtol=1e-2)

  # bf16 angles (the bug this guards against) are wrong by whole turns: the test can tell.
  inv_freq, _ = posenc.rope_frequencies(head_dim)
  angle_bf16 = pos.astype(jnp.bfloat16)[:, :, None] * inv_freq.astype(jnp.bfloat16)[None, None, :]
  q_bad = posenc.apply_rotary(q, jnp.sin(angle_bf16), jnp.cos(angle_bf16))
  assert np.max(np.abs(np.asarray(q_bad.astype(jnp.float32))[0] - ref)) > 0.5


def test_rope_gqa_keys_with_fewer_heads_rotate_like_queries():
  pe = make("rope", num_heads=4)
  q = normal(0, (2, 5, 4, 16))
  k = q[:, :, 1:2]  # one kv head
  pos = jnp.array([[0, 1, 2, 3, 4], [9, 8, 100, 7, 6]], jnp.int32)
  q2, k2 = rotate(pe, q, k, pos, pos)
  assert k2.shape == (2, 5, 1, 16)
  np.testing.assert_allclose(k2[:, :, 0], q2[:, :, 1], atol=1e-6)


def test_rope_partial_rotary_passes_remaining_dims_through():
  pe = make("rope", rope_fraction=0.25, head_dim=16)  # 4 rotary dims
  q = normal(0, (1, 4, 2, 16))
  pos = jnp.array([[1, 5, 50, 500]], jnp.int32)
  q2, _ = rotate(pe, q, q, pos, pos)
  np.testing.assert_array_equal(q2[..., 4:], q[..., 4:])
  assert float(jnp.min(jnp.max(jnp.abs(q2[..., :4] - q[..., :4]), axis=-1))) > 1e-3


def test_rope_attention_factor_scales_scores_by_its_square():
  scaling = RopeScaling(kind="yarn", factor=8.0, original_max_len=64)
  pe = make("rope", scaling=scaling)
  inv_freq, factor = posenc.rope_frequencies(16, scaling=scaling)
  assert factor == pytest.approx(0.1 * math.log(8.0) + 1.0)
  q, k = normal(0, (1, 6, 4, 16)), normal(1, (1, 6, 4, 16))
  pos = jnp.array([[0, 3, 70, 200, 400, 511]], jnp.int32)
  sin, cos = posenc.rope_sin_cos(pos, inv_freq)
  q1, k1 = posenc.apply_rotary(q, sin, cos), posenc.apply_rotary(k, sin, cos)
  np.testing.assert_allclose(
    scores_BHLS(*rotate(pe, q, k, pos, pos)), factor**2 * scores_BHLS(q1, k1), rtol=1e-4, atol=1e-4
  )


def test_rope_dynamic_ntk_reads_length_from_key_positions_inside_jit():
  scaling = RopeScaling(kind="dynamic", factor=4.0, original_max_len=32)
  pe = make("rope", scaling=scaling)
  plain = make("rope")
  q, k = normal(0, (1, 4, 4, 16)), normal(1, (1, 4, 4, 16))

  short = jnp.array([[0, 5, 10, 31]], jnp.int32)  # length 32 = L0: unscaled
  np.testing.assert_allclose(
    rotate(pe, q, k, short, short)[0], rotate(plain, q, k, short, short)[0], atol=1e-6
  )

  long = jnp.array([[0, 5, 10, 99]], jnp.int32)  # length 100 > L0: base grows
  inv_freq, _ = posenc.rope_frequencies(16, scaling=scaling, seq_len=100)
  sin, cos = posenc.rope_sin_cos(long, inv_freq)
  np.testing.assert_allclose(
    rotate(pe, q, k, long, long)[0], posenc.apply_rotary(q, sin, cos), atol=1e-5
  )
  assert (
    float(jnp.max(jnp.abs(rotate(pe, q, k, long, long)[0] - rotate(plain, q, k, long, long)[0])))
    > 0.1
  )


# ---- RoPE frequencies and scalings against Hugging Face ----


@pytest.mark.parametrize("case", ROPE_HF["cases"], ids=lambda c: c["name"])
def test_rope_frequencies_match_hf_fixture(case):
  inv_freq, factor = posenc.rope_frequencies(
    case["head_dim"], case["max_wavelength"], case["scaling"], seq_len=case["seq_len"]
  )
  assert inv_freq.dtype == jnp.float32 and inv_freq.shape == (case["head_dim"] // 2,)
  np.testing.assert_allclose(np.asarray(inv_freq, np.float64), case["inv_freq"], rtol=1e-6)
  assert factor == pytest.approx(case["attention_factor"], rel=1e-12)


def test_rope_frequencies_dynamic_with_array_length_match_hf_fixture():
  cases = [c for c in ROPE_HF["cases"] if c["scaling"]["kind"] == "dynamic"]
  assert len(cases) >= 20 and any(c["seq_len"] < c["scaling"]["original_max_len"] for c in cases)
  for case in cases:  # a jax array length takes the float32 path that runs inside jit
    inv_freq, _ = posenc.rope_frequencies(
      case["head_dim"], scaling=case["scaling"], seq_len=jnp.int32(case["seq_len"])
    )
    got = np.asarray(inv_freq, np.float64)
    np.testing.assert_allclose(got, case["inv_freq"], rtol=1e-6, err_msg=case["name"])
  # The same path traced under jit.
  case = cases[-1]
  fn = jax.jit(
    lambda n: posenc.rope_frequencies(case["head_dim"], scaling=case["scaling"], seq_len=n)
  )
  np.testing.assert_allclose(fn(jnp.int32(case["seq_len"]))[0], case["inv_freq"], rtol=1e-6)


def test_rope_frequencies_ntk_by_parts_is_yarn_without_attention_factor():
  cases = [c for c in ROPE_HF["cases"] if c["scaling"]["kind"] == "yarn"]
  assert any(c["attention_factor"] != 1.0 for c in cases)
  for case in cases:
    scaling = {**case["scaling"], "kind": "ntk_by_parts"}
    inv_freq, factor = posenc.rope_frequencies(case["head_dim"], case["max_wavelength"], scaling)
    np.testing.assert_allclose(np.asarray(inv_freq, np.float64), case["inv_freq"], rtol=1e-6)
    assert factor == 1.0


def test_rope_frequencies_static_ntk_equals_hf_dynamic_at_the_same_base():
  # HF dynamic NTK at length 8 * L0 with factor 2 uses b * 15^(d/(d-2)): static NTK with 15.
  case = next(c for c in ROPE_HF["cases"] if c["name"] == "dynamic_d64_s2_l0512_len4096")
  inv_freq, factor = posenc.rope_frequencies(64, scaling={"kind": "ntk", "factor": 15.0})
  np.testing.assert_allclose(np.asarray(inv_freq, np.float64), case["inv_freq"], rtol=1e-6)
  assert factor == 1.0


@pytest.mark.parametrize("kind", ["dynamic", "ntk_by_parts", "yarn", "llama3"])
def test_rope_frequencies_without_original_len_raises(kind):
  with pytest.raises(ValueError, match="posenc.scaling.original_max_len"):
    posenc.rope_frequencies(64, scaling={"kind": kind, "factor": 4.0})
  with pytest.raises(ValueError, match="posenc.scaling.original_max_len"):
    make("rope", scaling=RopeScaling(kind=kind, factor=4.0))


def test_rope_long_term_decay_decreases_with_distance():
  bound = posenc.rope_long_term_decay(128, 256)
  assert bound.shape == (257,)
  assert bound[0] == pytest.approx(32.5)  # |S_j| = j at m = 0, mean of 1..64
  window_means = bound[:256].reshape(8, 32).mean(axis=1)
  assert np.all(np.diff(window_means) < 0)
  assert np.polyfit(np.arange(257), bound, 1)[0] < 0
  assert bound[256] < 0.3 * bound[0]


# ---- ALiBi ----


def test_alibi_slopes_for_8_heads_are_powers_of_one_half():
  np.testing.assert_array_equal(posenc.alibi_slopes(8), [2.0**-k for k in range(1, 9)])


@pytest.mark.parametrize(
  "num_heads,expected_log2",
  [
    # 6 heads: the 4-head slopes, then every other 8-head slope (2^-1, 2^-3).
    (6, [-2, -4, -6, -8, -1, -3]),
    # 12 heads: the 8-head slopes, then every other 16-head slope (2^-0.5, 2^-1.5, ...).
    (12, [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]),
    (1, [-8]),
    (3, [-4, -8, -2]),
  ],
)
def test_alibi_slopes_for_other_head_counts_follow_the_paper_rule(num_heads, expected_log2):
  slopes = posenc.alibi_slopes(num_heads)
  assert slopes.dtype == jnp.float32
  np.testing.assert_allclose(slopes, [2.0**e for e in expected_log2], rtol=1e-7)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_penalises_distance_linearly(causal):
  pe = make("alibi", num_heads=8, causal=causal)
  qpos = jnp.array([[10, 11, 12]], jnp.int32)
  kpos = jnp.array([[3, 10, 12, 15]], jnp.int32)
  bias_BHLS = bias(pe, qpos, kpos)
  assert bias_BHLS.shape == (1, 8, 3, 4) and bias_BHLS.dtype == jnp.float32
  distance = np.array([[7, 0, -2, -5], [8, 1, -1, -4], [9, 2, 0, -3]], np.float32)
  if not causal:
    distance = np.abs(distance)
  slopes = np.asarray(posenc.alibi_slopes(8))
  np.testing.assert_allclose(bias_BHLS[0], -slopes[:, None, None] * distance[None], rtol=1e-7)


# ---- T5 ----


@pytest.mark.parametrize(
  "table",
  T5_BUCKETS["tables"],
  ids=lambda t: (
    f"{'bi' if t['bidirectional'] else 'causal'}_{t['num_buckets']}_{t['max_distance']}"
  ),
)
def test_t5_relative_bucket_matches_reference_table(table):
  rel = jnp.array(T5_BUCKETS["relative_position"], jnp.int32)
  buckets = posenc.t5_relative_bucket(
    rel,
    bidirectional=table["bidirectional"],
    num_buckets=table["num_buckets"],
    max_distance=table["max_distance"],
  )
  assert buckets.dtype == jnp.int32
  np.testing.assert_array_equal(buckets, table["buckets"])


@pytest.mark.parametrize("causal", [True, False])
def test_t5_bias_looks_up_bucket_of_key_minus_query(causal):
  pe = make("t5", num_heads=3, causal=causal)
  table = np.asarray(pe.table[...])
  assert table.shape == (3, 32) and pe.table.get_metadata()["out_sharding"] == ("heads", None)
  qpos = jnp.array([[0, 50, 400], [7, 7, 7]], jnp.int32)
  kpos = jnp.array([[0, 1, 60, 399], [0, 6, 8, 300]], jnp.int32)
  bias_BHLS = np.asarray(bias(pe, qpos, kpos))
  assert bias_BHLS.shape == (2, 3, 3, 4) and bias_BHLS.dtype == np.float32
  buckets = np.asarray(
    jax.jit(posenc.t5_relative_bucket, static_argnames="bidirectional")(
      kpos[:, None, :] - qpos[:, :, None], bidirectional=not causal
    )
  )
  np.testing.assert_array_equal(bias_BHLS, np.moveaxis(table[:, buckets], 0, 1))


@pytest.mark.parametrize("kind", ["alibi", "t5"])
def test_relative_bias_of_a_block_equals_that_block_of_the_full_bias(kind):
  pe = make(kind, causal=False)
  pos = jnp.arange(40, dtype=jnp.int32)[None, :] + 3
  full = bias(pe, pos, pos)
  block = bias(pe, pos[:, 8:16], pos[:, 24:40])
  np.testing.assert_array_equal(block, full[:, :, 8:16, 24:40])


# ---- xPos ----


def test_xpos_scores_depend_only_on_relative_offset_even_far_from_origin():
  pe = make("xpos")
  q_LHK, k_SHK = normal(0, (6, 4, 16)), normal(1, (6, 4, 16))
  pos = [0, 1, 3, 7, 20, 50]
  s_BHLS = shifted_scores(pe, q_LHK, k_SHK, pos, pos, shifts=[0, 1, 517, 4096, 100_000])
  # Uncentred, zeta^(-100000/512) would overflow float32.
  assert bool(jnp.all(jnp.isfinite(s_BHLS)))
  # float32 angles at position 1e5 are off by ~6e-3 rad, hence the tolerance.
  np.testing.assert_allclose(s_BHLS[1:], jnp.broadcast_to(s_BHLS[:1], s_BHLS[1:].shape), atol=3e-2)


def test_xpos_scores_do_not_depend_on_the_other_keys_of_the_call():
  # The centring constant comes from the keys of the row; it must cancel in every score.
  pe = make("xpos")
  q, k = normal(0, (1, 3, 4, 16)), normal(1, (1, 3, 4, 16))
  qpos = jnp.array([[40, 41, 42]], jnp.int32)
  kpos = jnp.array([[30, 35, 40]], jnp.int32)
  alone = scores_BHLS(*rotate(pe, q, k, qpos, kpos))
  far_keys = jnp.concatenate([k, normal(2, (1, 2, 4, 16))], axis=1)
  kpos_far = jnp.concatenate([kpos, jnp.array([[-3000, -2000]], jnp.int32)], axis=1)
  with_far = scores_BHLS(*rotate(pe, q, far_keys, qpos, kpos_far))[..., :3]
  np.testing.assert_allclose(with_far, alone, rtol=1e-4, atol=1e-5)


def test_xpos_scores_decay_with_distance():
  pe = make("xpos", head_dim=16)
  rope = make("rope", head_dim=16)
  zeta = (np.arange(0, 16, 2) + 0.4 * 16) / (1.4 * 16)
  distances = np.array([0, 1, 16, 128, 512, 2048])
  qpos = jnp.full((1, 6), 3000, jnp.int32)
  kpos = jnp.asarray(3000 - distances, jnp.int32)[None, :]
  for pair in (0, 3):  # a query/key living in one rotation pair sees exactly that pair's zeta
    x = np.zeros((1, 6, 1, 16), np.float32)
    x[..., 2 * pair : 2 * pair + 2] = [0.6, 0.8]
    x = jnp.asarray(x)
    xs = jnp.einsum("blhk,blhk->bl", *rotate(pe, x, x, qpos, kpos))
    rs = jnp.einsum("blhk,blhk->bl", *rotate(rope, x, x, qpos, kpos))
    ratio = np.asarray(xs / rs)[0]
    np.testing.assert_allclose(ratio, zeta[pair] ** (distances / 512.0), rtol=1e-4)
    assert np.all(np.diff(ratio) < 0)


def test_xpos_preserves_dtype_and_is_causal_only():
  pe = make("xpos")
  q = normal(0, (1, 3, 4, 16), jnp.bfloat16)
  pos = jnp.array([[0, 1, 2]], jnp.int32)
  q2, k2 = rotate(pe, q, q, pos, pos)
  assert q2.dtype == jnp.bfloat16 and k2.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="posenc.kind='xpos' needs a causal decoder"):
    make("xpos", causal=False)


# ---- Absolute encodings and the identity hooks ----


@pytest.mark.parametrize("kind", ["nope", "sinusoidal", "learned", "alibi", "t5"])
def test_non_rotary_encodings_leave_queries_and_keys_untouched(kind):
  pe = make(kind)
  q, k = normal(0, (2, 3, 4, 16), jnp.bfloat16), normal(1, (2, 5, 2, 16), jnp.bfloat16)
  qpos = jnp.array([[0, 1, 2], [4, 5, 6]], jnp.int32)
  kpos = jnp.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], jnp.int32)
  q2, k2 = rotate(pe, q, k, qpos, kpos)
  np.testing.assert_array_equal(q2, q)
  np.testing.assert_array_equal(k2, k)
  assert q2.dtype == q.dtype and k2.dtype == k.dtype


@pytest.mark.parametrize("kind", ["rope", "xpos", "alibi", "t5", "nope"])
def test_non_absolute_encodings_leave_embeddings_untouched(kind):
  pe = make(kind)
  x = normal(0, (2, 3, 64))
  pos = jnp.array([[0, 1, 2], [4, 5, 6]], jnp.int32)
  np.testing.assert_array_equal(embed(pe, x, pos), x)
  assert (bias(pe, pos, pos) is None) == (kind not in ("alibi", "t5"))


def test_sinusoidal_embed_adds_vaswani_table_sin_even_cos_odd():
  pe = make("sinusoidal", emb_dim=10)
  pos = jnp.array([[0, 1, 2, 700]], jnp.int32)
  x = jnp.ones((1, 4, 10), jnp.bfloat16)
  out = embed(pe, x, pos)
  assert out.dtype == jnp.bfloat16
  p = np.array([0, 1, 2, 700], np.float64)[:, None]
  j = np.arange(10)[None, :]
  angle = p / 10000.0 ** (2 * (j // 2) / 10)
  expected = np.where(j % 2 == 0, np.sin(angle), np.cos(angle))
  np.testing.assert_allclose(np.asarray(out, np.float32)[0] - 1.0, expected, atol=1e-2)
  got32 = posenc.sinusoidal_embedding(pos, 10)
  np.testing.assert_allclose(got32[0], expected, atol=2e-4)


def test_learned_embed_adds_table_rows_and_holds_logical_axes():
  pe = make("learned", emb_dim=8, max_len=16)
  table = np.asarray(pe.table[...])
  assert table.shape == (16, 8) and pe.table.get_metadata()["out_sharding"] == (None, "embed")
  assert 0.01 < table.std() < 0.03  # normal(0.02) init
  pos = jnp.array([[3, 0, 15]], jnp.int32)
  x = normal(0, (1, 3, 8))
  np.testing.assert_allclose(embed(pe, x, pos), np.asarray(x) + table[[3, 0, 15]][None], rtol=1e-6)
  # A position with no row reads NaN instead of a silently clamped row.
  assert bool(jnp.all(jnp.isnan(embed(pe, x, jnp.array([[3, 16, 0]], jnp.int32))[0, 1])))


def test_learned_embed_past_max_len_raises_naming_max_len():
  pe = make("learned", emb_dim=8, max_len=16)
  x = jnp.zeros((1, 17, 8))
  with pytest.raises(ValueError, match="posenc.max_len") as err:
    embed(pe, x, jnp.arange(17, dtype=jnp.int32)[None, :])
  for kind in ("rope", "alibi", "t5", "xpos", "nope"):
    assert kind in str(err.value)


def test_params_are_born_sharded_under_a_mesh_with_logical_rules():
  mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh), nnx.logical_axis_rules((("embed", "fsdp"), ("heads", None))):
    learned = posenc.make_posenc(
      PosEncConfig(kind="learned"),
      num_heads=2,
      head_dim=8,
      emb_dim=16,
      causal=True,
      rngs=nnx.Rngs(0),
    )
  assert learned.table[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


@pytest.mark.parametrize("kind", tuple(POSENCS))
def test_posenc_modules_run_under_jit_as_pytrees(kind):
  fields = {}
  if kind in ("rope", "xpos"):
    fields["scaling"] = RopeScaling(kind="dynamic", factor=2.0, original_max_len=4)
  pe = make(kind, **fields)
  x, q = normal(0, (1, 6, 64)), normal(1, (1, 6, 4, 16))
  pos = jnp.arange(6, dtype=jnp.int32)[None, :]

  @jax.jit
  def run(pe, x, q, pos):
    q2, k2 = pe.rotate(q, q, pos, pos)
    bias_BHLS = pe.bias(pos, pos)
    return pe.embed(x, pos), q2, k2, (jnp.zeros((1, 4, 6, 6)) if bias_BHLS is None else bias_BHLS)

  x2, q2, k2, bias_BHLS = run(pe, x, q, pos)
  # Queries and keys come back as wide as the kind says (PoPE's twice the head dim).
  cls = POSENCS[kind]
  width = cls.rotated_dim(pe.cfg, 16)
  if cls.rotated_dim.__func__ is PosEnc.rotated_dim.__func__:  # PoPE's are wider (pope_test)
    assert width == 16
  assert x2.shape == x.shape and q2.shape == k2.shape == (1, 6, 4, width)
  assert bias_BHLS.shape == (1, 4, 6, 6)
  assert all(bool(jnp.all(jnp.isfinite(a))) for a in (x2, q2, k2, bias_BHLS))
  # Exactly the hooks its class overrides changed something (the registry's kinds: sinusoidal
  # and learned embed; rope, xpos and pope rotate; alibi, t5, kerple, fire and sandwich bias).
  assert bool(jnp.any(x2 != x)) == (cls.embed is not PosEnc.embed)
  assert (q2.shape != q.shape or bool(jnp.any(q2 != q))) == (cls.rotate is not PosEnc.rotate)
  assert bool(jnp.any(bias_BHLS != 0)) == (cls.bias is not PosEnc.bias)


@pytest.mark.parametrize("causal", [True, False])
def test_make_posenc_builds_under_eval_shape_for_every_kind(causal):
  # Restoring a checkpoint or a sharded init builds the model, and so its encoding, in a trace.
  for kind in [k for k in tuple(POSENCS) if causal or not posenc.POSENCS[k].causal_only]:
    concrete = make(kind, causal=causal)
    abstract = nnx.eval_shape(lambda kind=kind: make(kind, causal=causal))
    assert type(abstract) is type(concrete)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(abstract))
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(concrete))
  alibi = nnx.eval_shape(lambda: make("alibi", num_heads=8, causal=causal))
  assert alibi.slopes == tuple(2.0**-k for k in range(1, 9))
