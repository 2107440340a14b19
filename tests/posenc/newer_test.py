"""Tests of the newer encodings (kerple, fire, sandwich, p-RoPE, cope) against hand computations."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import posenc, testing
from roformer.nn.attention import kernels as attention
from roformer.nn.attention.call import AttentionCall
from roformer.posenc.config import PosEncConfig


def make(kind, *, num_heads=2, head_dim=4, emb_dim=8, **fields):
  return testing.build_posenc(
    kind, num_heads=num_heads, head_dim=head_dim, emb_dim=emb_dim, **fields
  )


def pos(*values):
  return jnp.asarray([values], jnp.int32)


def test_kerple_bias_is_minus_r1_log_one_plus_r2_distance():
  pe = make("kerple")
  pe.r1[...] = jnp.asarray([0.5, 2.0])
  pe.r2[...] = jnp.asarray([1.0, 0.25])
  got = np.asarray(pe.bias(pos(3), pos(0, 1, 3)))[0, :, 0]  # query at 3: distances 3, 2, 0
  want = [
    [-0.5 * math.log(1 + 3.0), -0.5 * math.log(1 + 2.0), 0.0],
    [-2.0 * math.log(1 + 0.75), -2.0 * math.log(1 + 0.5), 0.0],
  ]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_kerple_clamps_r1_and_r2_at_the_papers_epsilon():
  pe = make("kerple")
  pe.r1[...] = jnp.asarray([-1.0, 1.0])
  pe.r2[...] = jnp.asarray([1.0, -3.0])
  got = np.asarray(pe.bias(pos(4), pos(0)))[0, :, 0, 0]
  np.testing.assert_allclose(got, [-0.01 * math.log(5.0), -math.log(1 + 0.04)], rtol=1e-6)


def test_kerple_gradient_flows_below_the_clamp_and_constrain_clamps_in_place():
  # A forward max(r, 0.01) has gradient 0 for r < 0.01: the parameter would never move again.
  pe = make("kerple")
  pe.r1[...] = jnp.asarray([0.001, 1.0])
  pe.r2[...] = jnp.asarray([0.5, 0.005])

  def loss(pe):
    return pe.bias(pos(6), pos(0, 2, 5)).sum()

  grads = nnx.grad(loss)(pe)
  g1, g2 = np.asarray(grads.r1[...]), np.asarray(grads.r2[...])
  assert g1[0] != 0 and g2[1] != 0
  # Straight through: the gradient at r < eps is the gradient at r = eps.
  at_eps = make("kerple")
  at_eps.r1[...] = jnp.asarray([0.01, 1.0])
  at_eps.r2[...] = jnp.asarray([0.5, 0.01])
  eps_grads = nnx.grad(loss)(at_eps)
  np.testing.assert_allclose(g1, np.asarray(eps_grads.r1[...]), rtol=1e-6)
  np.testing.assert_allclose(g2, np.asarray(eps_grads.r2[...]), rtol=1e-6)
  pe.constrain()
  np.testing.assert_allclose(np.asarray(pe.r1[...]), [0.01, 1.0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(pe.r2[...]), [0.5, 0.01], rtol=1e-6)


def test_kerple_initialisation_follows_the_paper():
  pe = make("kerple", num_heads=64)
  r1, r2 = np.asarray(pe.r1[...]), np.asarray(pe.r2[...])
  assert 0 <= r1.min() and r1.max() <= 2 and r1.max() > 1  # U(0, 2)
  assert 0 <= r2.min() and r2.max() <= 1  # U(0, 1)


def test_fire_bias_is_the_mlp_of_the_progressively_normalised_log_distance():
  pe = make("fire", fire_mlp_width=1, fire_init_c=1.0, fire_init_threshold=2.0)
  pe.w1[...] = jnp.asarray([1.0])
  pe.b1[...] = jnp.asarray([0.0])
  pe.w2[...] = jnp.asarray([[2.0, -1.0]])
  pe.b2[...] = jnp.asarray([0.5, 0.0])
  got = np.asarray(pe.bias(pos(1, 3), pos(0, 1)))[0]  # [H, 2 queries, 2 keys]
  # query 1: normaliser log(max(2, 1) + 1) = log 3; query 3: log(3 + 1) = log 4.
  x = np.array(
    [[math.log(2) / math.log(3), 0.0], [math.log(4) / math.log(4), math.log(3) / math.log(4)]]
  )
  x = x / (1 + 1e-6 / np.array([[math.log(3)], [math.log(4)]]))  # the eps of the normaliser
  np.testing.assert_allclose(got[0], 2 * x + 0.5, rtol=1e-6)
  np.testing.assert_allclose(got[1], -x, rtol=1e-6)


def test_fire_defaults_are_the_papers():
  pe = make("fire")
  assert pe.w1[...].shape == (32,) and pe.w2[...].shape == (32, 2)
  assert float(pe.c[...]) == pytest.approx(0.1) and float(pe.l_multiplier[...]) == 1.0
  assert pe.cfg.fire_init_threshold == 512.0


def test_sandwich_bias_is_the_compressed_inner_product_of_sinusoids():
  pe = make("sandwich", num_heads=2, sandwich_dim=4)
  got = np.asarray(pe.bias(pos(5), pos(0, 3, 5)))[0, :, 0]  # distances 5, 2, 0
  # d' = 4: theta_1 = 10000^(-2/4) = 0.01, theta_2 = 10000^(-4/4) = 1e-4; heads divide by 8h/2.
  inner = [math.cos(0.01 * d) + math.cos(1e-4 * d) - 2 for d in (5, 2, 0)]
  np.testing.assert_allclose(got[0], np.array(inner) / 4, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(got[1], np.array(inner) / 8, rtol=1e-5, atol=1e-9)


def test_sandwich_dim_defaults_to_the_model_width():
  assert make("sandwich", emb_dim=8).dim == 8


def test_rope_truncate_zeroes_the_lowest_frequencies_and_leaves_their_dims_unrotated():
  pe = make("rope", head_dim=8, num_heads=1, rope_truncate=0.5)
  inv_freq, _ = pe.frequencies(pos(0))
  # head_dim 8: theta = 10000^(-2i/8) = 1, 0.1, 0.01, 0.001; the two lowest are truncated.
  np.testing.assert_allclose(np.asarray(inv_freq), [1.0, 0.1, 0.0, 0.0], rtol=1e-6)
  q = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 1, 8) + 1.0
  q_rot, _ = pe.rotate(q, q, pos(7), pos(7))
  np.testing.assert_array_equal(np.asarray(q_rot)[..., 4:], np.asarray(q)[..., 4:])
  c, s = math.cos(7.0), math.sin(7.0)  # pair (0, 1) rotates by 7 * theta_0 = 7
  np.testing.assert_allclose(np.asarray(q_rot)[0, 0, 0, :2], [c - 2 * s, 2 * c + s], rtol=1e-5)


def test_rope_truncate_keeps_floor_p_of_the_frequencies_as_gemma_and_hf_do():
  # p = 1 - rope_truncate; HF's proportional RoPE (Gemma) rotates int(p * d/2) frequencies.
  for head_dim, truncate, kept in ((64, 0.2, 25), (128, 0.1, 57), (10, 0.5, 2), (64, 0.25, 24),
                                   (10, 0.3, 3), (16, 0.0, 8)):  # fmt: skip
    inv_freq, _ = make("rope", head_dim=head_dim, num_heads=1, rope_truncate=truncate).frequencies(
      pos(0)
    )
    assert int(np.count_nonzero(np.asarray(inv_freq))) == kept, (head_dim, truncate)


def test_rope_truncate_is_refused_for_non_rotary_encodings():
  with pytest.raises(ValueError, match="posenc.rope_truncate"):
    make("alibi", rope_truncate=0.25)
  with pytest.raises(ValueError, match=r"posenc.rope_truncate=1.0 must be in \[0, 1\)"):
    make("rope", rope_truncate=1.0)


def _cope_by_hand(q, k, pos_emb):
  """CoPE's bias for one head with a causal mask, written out with loops (float64)."""
  L, K = q.shape
  P = pos_emb.shape[0]
  out = np.zeros((L, L))
  for i in range(L):
    for j in range(i + 1):
      # The gates read the scaled logits (the paper's code: sigmoid(q . k / sqrt(K))).
      p = sum(1 / (1 + math.exp(-q[i] @ k[t] / math.sqrt(K))) for t in range(j, i + 1))
      p = min(p, P - 1)
      lo, hi = math.floor(p), math.ceil(p)
      w = p - lo
      out[i, j] = (w * (q[i] @ pos_emb[hi]) + (1 - w) * (q[i] @ pos_emb[lo])) / math.sqrt(K)
  return out


def test_cope_content_bias_matches_a_hand_computation():
  pe = make("cope", num_heads=1, head_dim=2, cope_npos_max=3)
  pos_emb = np.array([[0.0, 1.0], [1.0, -1.0], [0.5, 2.0]])
  pe.pos_emb[...] = jnp.asarray(pos_emb, jnp.float32)
  q = np.array([[0.5, -1.0], [1.0, 0.5], [2.0, 1.0], [-0.5, 1.5]])
  k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])
  mask = np.tril(np.ones((4, 4), bool))
  got = pe.content_bias(
    jnp.asarray(q, jnp.float32)[None, :, None],
    jnp.asarray(k, jnp.float32)[None, :, None],
    jnp.asarray(mask)[None],
  )
  want = _cope_by_hand(q, k, pos_emb)
  np.testing.assert_allclose(np.asarray(got)[0, 0] * mask, want, rtol=1e-5, atol=1e-6)
  # The count reaches past P - 1 = 2 for the query at 3 and the first key: clamped there.
  p_30 = sum(1 / (1 + math.exp(-q[3] @ k[t] / math.sqrt(2))) for t in range(4))
  assert p_30 > 2
  assert np.asarray(got)[0, 0, 3, 0] == pytest.approx(q[3] @ pos_emb[2] / math.sqrt(2), rel=1e-5)


def _qkv(L=12, H=2, K=4, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((1, L, H, K)), jnp.float32) for _ in range(3))
  return q, k, v, jnp.arange(L, dtype=jnp.int32)[None]


def test_cope_is_refused_by_the_chunked_kernel_and_routed_to_dense_by_auto():
  pe = make("cope", num_heads=2, head_dim=4, cope_npos_max=64)
  pe.pos_emb[...] = jnp.asarray(np.random.default_rng(1).standard_normal((64, 4)), jnp.float32)
  q, k, v, p = _qkv()
  kwargs = dict(causal=True, bias_fn=pe.bias, content_bias_fn=pe.content_bias, block=4)
  with pytest.raises(ValueError, match="chunked attention kernel cannot add a content-dependent"):
    attention.chunked_attention(q, k, v, p, p, AttentionCall(**kwargs))
  dense = attention.dense_attention(q, k, v, p, p, AttentionCall(**kwargs))
  # 12 * 12 > 4 * 4: long for auto
  auto = attention.auto_attention(q, k, v, p, p, AttentionCall(**kwargs))
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(dense))
  without = attention.dense_attention(q, k, v, p, p, AttentionCall(causal=True, block=4))
  assert np.abs(np.asarray(dense) - np.asarray(without)).max() > 1e-3  # the bias is applied


def test_cope_config_is_refused_with_the_chunked_kernel_and_for_encoders():
  cfg = PosEncConfig(kind="cope")
  # The chunked kernel's own misfit refuses it when the model config is built.
  with pytest.raises(ValueError, match="cannot add a content-dependent positional bias"):
    testing.tiny_model_config("cope", attention_impl="chunked")
  with pytest.raises(ValueError, match="needs a causal decoder"):
    posenc.validate_posenc(cfg, causal=False, head_dim=4)


@pytest.mark.parametrize("kind", ["kerple", "fire", "sandwich"])
def test_new_biases_give_the_same_attention_in_chunked_and_dense_kernels(kind):
  pe = make(kind, num_heads=2, head_dim=4)
  q, k, v, p = _qkv(L=20)
  p = p + 1000  # far from 0: FIRE's normaliser and the distances must come from the positions
  kwargs = dict(causal=True, bias_fn=pe.bias, block=8)
  dense = attention.dense_attention(q, k, v, p, p, AttentionCall(**kwargs))
  chunked = attention.chunked_attention(q, k, v, p, p, AttentionCall(**kwargs))
  assert float(jnp.abs(dense - chunked).max()) < 1e-5


def test_randomize_max_reaches_the_learned_table_check():
  with pytest.raises(ValueError, match="posenc.max_len=64"):
    posenc.validate_posenc(
      PosEncConfig(kind="learned", max_len=64, randomize_max=128), causal=True, head_dim=4
    )
  posenc.validate_posenc(
    PosEncConfig(kind="learned", max_len=128, randomize_max=128), causal=True, head_dim=4
  )


@pytest.mark.parametrize("kind", ["nope", "cope"])
def test_randomize_max_is_refused_for_encodings_that_never_read_positions(kind):
  with pytest.raises(ValueError, match=f"posenc.kind='{kind}' never reads"):
    posenc.validate_posenc(PosEncConfig(kind=kind, randomize_max=128), causal=True, head_dim=4)
  posenc.validate_posenc(PosEncConfig(kind=kind), causal=True, head_dim=4)
  posenc.validate_posenc(PosEncConfig(kind="rope", randomize_max=128), causal=True, head_dim=4)


def test_new_bias_gradients_reach_their_parameters():
  for kind, names in (("kerple", ("r1", "r2")), ("fire", ("w1", "w2", "c", "l_multiplier"))):
    pe = make(kind, fire_init_threshold=4.0)

    def loss(pe):
      return pe.bias(pos(0, 3, 9), pos(0, 2, 5, 9)).sum()

    grads = nnx.grad(loss)(pe)
    for name in names:
      assert float(jnp.abs(getattr(grads, name)[...]).sum()) > 0, (kind, name)


@pytest.mark.parametrize(
  "kind, fields, param",
  [("cope", {"cope_npos_max": 9}, "pos_emb"), ("fire", {}, "w2")],
)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_cope_and_fire_have_their_parameters_in_every_layer_unless_shared(
  kind, fields, param, scan_layers
):
  # Both papers' models give each attention layer its own encoding (CoPE's code: a table per
  # layer unless --cope-shared; FIRE, with FIRE-S its layer-shared variant).
  import dataclasses

  from roformer.nn.config import ModelConfig
  from roformer.nn.model import make_model

  cfg = ModelConfig(
    kind="decoder", num_layers=3, emb_dim=16, num_heads=2, mlp_dim=32, attention_impl="dense",
    scan_layers=scan_layers, posenc=PosEncConfig(kind=kind, **fields),
  )  # fmt: skip
  with nnx.use_eager_sharding(False):
    model = make_model(cfg, rngs=nnx.Rngs(0))
  paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  own = [p for p in paths if p.endswith(f"posenc/{param}")]
  if scan_layers:
    (path,) = own
    assert path.startswith("layers/")
    assert getattr(model.layers.posenc, param)[...].shape[0] == 3  # stacked: one per layer
  else:
    assert sorted(own) == [f"layers/{i}/posenc/{param}" for i in range(3)]
  tokens = jnp.zeros((1, 6), jnp.int32)
  positions = jnp.arange(6, dtype=jnp.int32)[None]
  assert model(tokens, positions).shape == (1, 6, cfg.vocab_size)

  shared_field = {"cope": "cope_shared", "fire": "fire_shared"}[kind]
  shared_cfg = dataclasses.replace(
    cfg, posenc=dataclasses.replace(cfg.posenc, **{shared_field: True})
  )
  with nnx.use_eager_sharding(False):
    shared = make_model(shared_cfg, rngs=nnx.Rngs(0))
  paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(shared, nnx.Param))]
  assert [p for p in paths if p.endswith(f"posenc/{param}")] == [f"posenc/{param}"]


def test_per_layer_encodings_give_layers_different_biases():
  # A per-layer FIRE draws each layer's MLP from that layer's keys: layers differ.
  from roformer.nn.config import ModelConfig
  from roformer.nn.model import make_model

  cfg = ModelConfig(
    kind="decoder", num_layers=2, emb_dim=16, num_heads=2, mlp_dim=32, attention_impl="dense",
    posenc=PosEncConfig(kind="fire"),
  )  # fmt: skip
  with nnx.use_eager_sharding(False):
    model = make_model(cfg, rngs=nnx.Rngs(0))
  b0, b1 = (np.asarray(layer.posenc.bias(pos(0, 5), pos(0, 5))) for layer in model.layers)
  assert np.abs(b0 - b1).max() > 1e-4
