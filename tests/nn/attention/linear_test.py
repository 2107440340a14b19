"""Tests of linear attention with RoPE (roformer/nn/attention/linear.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention.linear import LinearAttention, feature_map
from roformer.nn.config import ModelConfig, validate_model
from roformer.posenc import make_posenc
from roformer.posenc.config import PosEncConfig, RopeScaling

B, L, H, G, K = 2, 13, 4, 2, 8


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _layer(causal, fmap="elu", block=4):
  cfg = ModelConfig(
    kind="decoder" if causal else "encoder", emb_dim=16, num_heads=H, head_dim=K,
    num_kv_heads=G, attention="linear", linear_feature_map=fmap, attention_block=block,
    posenc=PosEncConfig(kind="rope"),
  )  # fmt: skip
  with nnx.use_eager_sharding(False):
    return LinearAttention(cfg, cfg.layers[0], rngs=nnx.Rngs(0))


def _rope(causal):
  with nnx.use_eager_sharding(False):
    return make_posenc(
      PosEncConfig(kind="rope"), num_heads=H, head_dim=K, emb_dim=16, causal=causal,
      rngs=nnx.Rngs(0),
    )  # fmt: skip


def _direct(q, k, v, pos, seg, posenc, causal, fmap):
  """Eq. 19 evaluated directly with an [L, L] matrix."""
  qf = feature_map(q, fmap, is_query=True)
  kf = feature_map(k, fmap, is_query=False)
  qr, kr = posenc.rotate(qf, kf, pos, pos)
  rep = lambda x: jnp.repeat(x, H // G, axis=2)  # noqa: E731
  num_BHLS = jnp.einsum("blhk,bshk->bhls", qr, rep(kr), precision="highest")
  den_BHLS = jnp.einsum("blhk,bshk->bhls", qf, rep(kf), precision="highest")
  mask_B1LS = (seg[:, :, None] == seg[:, None, :])[:, None]
  if causal:
    mask_B1LS &= jnp.tril(jnp.ones((L, L), bool))[None, None]
  num_BHLS, den_BHLS = jnp.where(mask_B1LS, num_BHLS, 0), jnp.where(mask_B1LS, den_BHLS, 0)
  o_BHLK = jnp.einsum("bhls,bshk->bhlk", num_BHLS, rep(v), precision="highest")
  return jnp.moveaxis(o_BHLK / den_BHLS.sum(-1)[..., None], 1, 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap", ["elu", "favor"])
def test_blockwise_linear_attention_equals_direct_evaluation(causal, fmap):
  x = _normal((B, L, 16), 0)
  pos = jnp.arange(L)[None, :] + jnp.array([[0], [40]])
  # Two packed documents in row 0 (split inside a chunk), one in row 1.
  seg = (jnp.arange(L)[None, :] >= jnp.array([[6], [L]])).astype(jnp.int32)
  posenc = _rope(causal)
  layer = _layer(causal, fmap)
  got, state = layer(x, pos, posenc, segment_ids_BL=seg)
  assert state is None  # no cache in, none out
  q, k, v = layer.qkv(x)
  want = _direct(q, k, v, pos, seg, posenc, causal, fmap)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rotated_numerator_scores_depend_only_on_relative_position():
  q, k = _normal((1, L, H, K), 3), _normal((1, L, G, K), 4)
  layer, posenc = _layer(True), _rope(True)

  def scores(shift):
    pos = jnp.arange(L)[None] + shift
    qr, _, kr, _ = layer._features(q, k, pos, posenc, None)
    return jnp.einsum("blgrk,bsgk->bgrls", qr, kr, precision="highest")

  base = scores(0)
  for shift in (7, 1000):
    np.testing.assert_allclose(scores(shift), base, rtol=1e-4, atol=1e-4)
  # The scores do depend on the positions (not on absolute ones): a different pairing changes them.
  qr, _, kr, _ = layer._features(q, k, jnp.arange(L)[None] * 2, posenc, None)
  assert np.abs(jnp.einsum("blgrk,bsgk->bgrls", qr, kr) - base).max() > 1e-2


LINEAR = dict(attention="linear", attention_block=4)


@pytest.mark.parametrize(
  "posenc, fields, fmap",
  [
    ("rope", None, "elu"),
    ("rope", {"scaling": RopeScaling(kind="dynamic", factor=2.0, original_max_len=4)}, "elu"),
    ("xpos", None, "elu"),
    ("sinusoidal", None, "favor"),
    ("nope", None, "elu"),
  ],
)
def test_recurrent_decoding_equals_full_forward(posenc, fields, fmap):
  testing.check_cached_generation(
    testing.tiny_model_config(posenc, fields, linear_feature_map=fmap, **LINEAR)
  )


def test_recurrent_state_has_constant_size():
  model = testing.random_model(testing.tiny_model_config(**LINEAR))
  short, long = model.init_caches(2, 8), model.init_caches(2, 8000)
  assert jax.tree.map(jnp.shape, short) == jax.tree.map(jnp.shape, long)


@pytest.mark.parametrize("kind", ["alibi", "t5"])
def test_bias_encodings_with_linear_attention_are_config_errors(kind):
  with pytest.raises(ValueError, match="adds a bias to the attention logits"):
    validate_model(testing.tiny_model_config(kind, **LINEAR))


def test_linear_attention_config_errors_name_the_field():
  with pytest.raises(ValueError, match="model.linear_feature_map"):
    validate_model(testing.tiny_model_config(linear_feature_map="relu", **LINEAR))
  with pytest.raises(ValueError, match="model.attention_window"):
    validate_model(dataclasses.replace(testing.tiny_model_config(**LINEAR), attention_window=4))
