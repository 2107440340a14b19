"""Tests of QK-norm (model.qk_norm): formulas and placement around the rotation."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention.qk_norm import l2_norm

K = 8


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _rms_by_hand(x, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def _attention(qk_norm):
  with nnx.use_eager_sharding(False):
    return testing.attention_layer(
      emb_dim=16, num_heads=4, head_dim=K, num_kv_heads=2, qk_norm=qk_norm, norm_eps=1e-5
    )


def test_l2_norm_divides_by_the_root_mean_square_as_llama4():
  x = _normal((2, 3, 4, K), 0) * 3.0
  np.testing.assert_allclose(l2_norm(x, 1e-5), _rms_by_hand(x, 1e-5), rtol=1e-5)
  # Llama4TextL2Norm's mean, not a sum: each head ends with norm sqrt(K), not 1.
  np.testing.assert_allclose(np.linalg.norm(l2_norm(x, 0.0), axis=-1), np.sqrt(K), rtol=1e-5)


def test_rmsnorm_scales_before_the_rotation_and_l2_normalises_after_it():
  rope = testing.build_posenc("rope", num_heads=4, head_dim=K)
  q, k = _normal((2, 5, 4, K), 1), _normal((2, 5, 2, K), 2)
  pos = testing.arange_positions(2, 5, start=3)
  attn = _attention("rmsnorm")
  # A scale per dim, so that the norm no longer commutes with the rotation.
  scale_q, scale_k = np.asarray(_normal((K,), 3)), np.asarray(_normal((K,), 4))
  attn.query_norm.scale[...], attn.key_norm.scale[...] = jnp.asarray(scale_q), jnp.asarray(scale_k)
  got_q, got_k = attn._encode(q, k, pos, rope, None)
  want_q, want_k = rope.rotate(
    jnp.asarray(_rms_by_hand(q, 1e-5) * scale_q, jnp.float32),
    jnp.asarray(_rms_by_hand(k, 1e-5) * scale_k, jnp.float32), pos, pos,
  )  # fmt: skip
  np.testing.assert_allclose(got_q, want_q, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_k, want_k, rtol=1e-5, atol=1e-5)
  rot_q, _ = rope.rotate(q, k, pos, pos)
  after_q = _rms_by_hand(rot_q, 1e-5) * scale_q  # the norm after RoPE instead differs
  assert not np.allclose(got_q, after_q, atol=1e-3)

  attn = _attention("l2")
  got_q, got_k = attn._encode(q, k, pos, rope, None)
  rot_q, rot_k = rope.rotate(q, k, pos, pos)
  np.testing.assert_allclose(got_q, _rms_by_hand(rot_q, 1e-5), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_k, _rms_by_hand(rot_k, 1e-5), rtol=1e-5, atol=1e-6)


def test_rmsnorm_whole_normalises_the_whole_projection_as_olmo2():
  # OLMo 2: RMSNorm over q_proj(x) of H * K values (k_proj: G * K), a scale per value, before
  # the heads are split and rotated.
  rope = testing.build_posenc("rope", num_heads=4, head_dim=K)
  q, k = _normal((2, 5, 4, K), 5), _normal((2, 5, 2, K), 6)
  pos = testing.arange_positions(2, 5, start=3)
  attn = _attention("rmsnorm_whole")
  assert attn.query_norm.scale.shape == (4, K) and attn.key_norm.scale.shape == (2, K)
  scale_q, scale_k = np.asarray(_normal((4, K), 7)), np.asarray(_normal((2, K), 8))
  attn.query_norm.scale[...], attn.key_norm.scale[...] = jnp.asarray(scale_q), jnp.asarray(scale_k)
  got_q, got_k = attn._encode(q, k, pos, rope, None)

  def olmo2(x, scale):  # the flat projection [B, L, N * K], normalised, then split into heads
    B, L, N, _ = x.shape
    flat = np.asarray(x, np.float64).reshape(B, L, N * K)
    return (_rms_by_hand(flat, 1e-5) * scale.reshape(N * K)).reshape(B, L, N, K)

  want_q, want_k = rope.rotate(
    jnp.asarray(olmo2(q, scale_q), jnp.float32), jnp.asarray(olmo2(k, scale_k), jnp.float32),
    pos, pos,
  )  # fmt: skip
  np.testing.assert_allclose(got_q, want_q, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_k, want_k, rtol=1e-5, atol=1e-5)
  # Negative control: per-head RMSNorm with the same scales gives other queries.
  per_head_q, _ = rope.rotate(
    jnp.asarray(_rms_by_hand(q, 1e-5) * scale_q, jnp.float32), k, pos, pos
  )
  assert not np.allclose(got_q, per_head_q, atol=1e-3)


def test_per_head_rmsnorm_bounds_each_head_where_the_whole_projection_does_not():
  # One head carries the query: per head it is brought to norm sqrt(K) like the others; over
  # the whole projection (scales 1) it keeps almost all of the norm sqrt(H K) = 2 sqrt(K).
  rope = testing.build_posenc("rope", num_heads=4, head_dim=K)
  q = _normal((1, 3, 4, K), 9) * jnp.array([1e4, 1.0, 1.0, 1.0])[None, None, :, None]
  k = _normal((1, 3, 2, K), 10)
  pos = testing.arange_positions(1, 3)
  per_head, _ = _attention("rmsnorm")._encode(q, k, pos, rope, None)
  whole, _ = _attention("rmsnorm_whole")._encode(q, k, pos, rope, None)
  np.testing.assert_allclose(np.linalg.norm(per_head, axis=-1), np.sqrt(K), rtol=1e-4)
  head0 = np.linalg.norm(np.asarray(whole)[:, :, 0], axis=-1)
  np.testing.assert_allclose(head0, 2 * np.sqrt(K), rtol=1e-4)
  np.testing.assert_allclose(np.linalg.norm(whole, axis=(-2, -1)), 2 * np.sqrt(K), rtol=1e-4)


def test_qk_norm_kinds_normalise_only_the_layers_of_those_kinds():
  cfg = testing.tiny_model_config(
    "rope", dict(layer_pattern="rope,nope"), num_layers=4, qk_norm="rmsnorm", qk_norm_kinds="rope"
  )
  model = testing.random_model(cfg)
  assert [layer.attn.query_norm is not None for layer in model.layers] == [True, False] * 2
  assert [layer.attn.qk_norm for layer in model.layers] == ["rmsnorm", "none"] * 2


@pytest.mark.parametrize(
  "fields, field",
  [
    (dict(qk_norm="l1"), "model.qk_norm='l1'"),
    (dict(qk_norm="l2", attention="mla", kv_lora_rank=8, qk_rope_head_dim=4), "model.qk_norm"),
    (dict(qk_norm="rmsnorm_whole", attention="linear"), "model.qk_norm"),
    (dict(qk_norm="none", qk_norm_kinds="rope"), "model.qk_norm_kinds"),
    (dict(qk_norm="l2", qk_norm_kinds="nope"), "model.qk_norm_kinds"),
  ],
)
def test_bad_qk_norm_settings_are_refused_naming_the_field(fields, field):
  with pytest.raises(ValueError, match=field):
    testing.tiny_model_config("rope", **fields)
