"""Tests of the query temperature (posenc.query_scale) against hand computations."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import posenc
from roformer.posenc import QueryScale
from roformer.posenc.config import PosEncConfig
from roformer.posenc.query_scale import SSMAX_INIT, llama4_scale, logn_scale


def test_logn_is_log_base_training_length_of_position_plus_one_beyond_it():
  pos = jnp.asarray([[0, 7, 8, 9, 63]])
  # Qwen's logn_list[p] = log(p + 1, L0) if p + 1 > L0 else 1, with L0 = 8.
  want = [1.0, 1.0, math.log(9, 8), math.log(10, 8), math.log(64, 8)]
  np.testing.assert_allclose(logn_scale(pos, 8)[0], want, rtol=1e-6)
  assert want[-1] == pytest.approx(2.0)


def test_llama4_temperature_steps_at_multiples_of_the_floor_scale():
  pos = jnp.asarray([[0, 8190, 8191, 16382, 16383, 100_000]])
  # 1 + 0.1 ln(floor((p + 1) / 8192) + 1)
  want = [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3),
          1 + 0.1 * math.log(100_001 // 8192 + 1)]  # fmt: skip
  np.testing.assert_allclose(llama4_scale(pos, 0.1, 8192.0)[0], want, rtol=1e-6)


def test_ssmax_multiplies_each_head_by_its_s_times_log_n():
  with nnx.use_eager_sharding(False):  # outside a mesh, as testing.build_posenc
    scale = QueryScale(PosEncConfig(query_scale="ssmax"), num_heads=3, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(scale.s[...], [SSMAX_INIT] * 3)
  scale.s[...] = jnp.asarray([0.5, 1.0, 2.0])
  q = jnp.ones((1, 4, 3, 2))
  out = np.asarray(scale(q, jnp.arange(4)[None]))
  for p in range(4):
    np.testing.assert_allclose(out[0, p, :, 0], [s * math.log(p + 1) for s in (0.5, 1.0, 2.0)],
                               rtol=1e-6, atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("kind, fields", [("logn", dict(query_scale_len=4)),
                                          ("llama4", dict(query_scale_floor=2.0))])  # fmt: skip
def test_query_scale_multiplies_queries_only_by_a_function_of_their_position(kind, fields):
  cfg = PosEncConfig(query_scale=kind, **fields)
  scale = QueryScale(cfg, num_heads=2, rngs=nnx.Rngs(0))
  q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 2, 4)), jnp.float32)
  pos = jnp.arange(9)[None] + jnp.asarray([[0], [3]])
  ratio = np.asarray(scale(q, pos) / q)
  assert np.allclose(ratio, ratio[..., :1, :1])  # one factor per position
  assert ratio[0, 0, 0, 0] == 1.0 and ratio[0, -1, 0, 0] > 1.0
  np.testing.assert_allclose(ratio[1, :6], ratio[0, 3:], rtol=1e-6)  # it reads positions


def test_query_scale_of_an_encoder_or_an_unknown_kind_is_refused_with_the_field():
  for cfg, causal, field in (
    (PosEncConfig(query_scale="logn", query_scale_len=8), False, "causal decoder"),
    (PosEncConfig(query_scale="log"), True, "posenc.query_scale='log'"),
    (PosEncConfig(query_scale="logn"), True, "posenc.query_scale_len=0"),
    (PosEncConfig(query_scale_kinds="nope", query_scale="llama4"), True, "query_scale_kinds"),
  ):
    with pytest.raises(ValueError, match=field):
      posenc.validate_posenc(cfg, causal=causal, head_dim=16)
