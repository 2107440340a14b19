"""Tests of PoPE (posenc.kind="pope") against hand computations, in the kernels and in a model.

Cached generation equals full forward passes for PoPE, alone and in a "pope,nope" pattern with a
windowed chunked kernel: tests/generate_test.py."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import config as config_lib
from roformer import posenc, testing
from roformer.config import OptimConfig
from roformer.data import ByteTokenizer
from roformer.evals import perplexity
from roformer.nn.attention import kernels
from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.kv_cache import KVCache
from roformer.nn.config import ModelConfig
from roformer.nn.model import make_model
from roformer.posenc.config import ContextExtension, PosEncConfig, RopeScaling
from roformer.posenc.pope import pope_features, pope_frequencies
from roformer.train import optimizer
from roformer.train import step as step_lib

TWO_PI = 2.0 * math.pi


def make(*, num_heads=2, num_kv_heads=1, head_dim=4, **fields):
  return testing.build_posenc(
    "pope", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
    emb_dim=num_heads * head_dim, **fields,
  )  # fmt: skip


def normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def pos(*rows):
  return jnp.asarray(rows, jnp.int32)


def softplus(x):
  return np.log1p(np.exp(np.asarray(x, np.float64)))


def score_by_hand(q_K, k_K, t, s, delta_K, base=10000.0):
  """The paper's a_ts / sqrt(K) = sum_c softplus(q_c) softplus(k_c) cos((s - t) theta_c +
  delta_c) / sqrt(K), theta_c = base^(-c/K), in float64 loops."""
  K = len(q_K)
  total = 0.0
  for c in range(K):
    theta = base ** (-c / K)
    total += softplus(q_K[c]) * softplus(k_K[c]) * math.cos((s - t) * theta + delta_K[c])
  return total / math.sqrt(K)


# ---- The formula ----


def test_frequencies_are_one_per_dim():
  # K = 4, base 10^4: theta_c = 10^(-4c/4) = 1, 0.1, 0.01, 0.001 (RoPE would have 2: 1, 0.01).
  np.testing.assert_allclose(pope_frequencies(4), [1.0, 0.1, 0.01, 0.001], rtol=1e-6)
  np.testing.assert_allclose(pope_frequencies(2, 100.0), [1.0, 0.1], rtol=1e-6)


def test_rotated_queries_and_keys_score_the_papers_formula():
  pe = make()  # 2 query heads share 1 key head
  delta = np.array([[-0.3, -1.0, -2.5, -6.0]])
  pe.delta[...] = jnp.asarray(delta, jnp.float32)
  q, k = normal(0, (1, 2, 2, 4)), normal(1, (1, 3, 1, 4))
  qpos, kpos = pos([7, 9]), pos([2, 7, 8])
  q2, k2 = pe.rotate(q, k, qpos, kpos)
  assert q2.shape == (1, 2, 2, 8) and k2.shape == (1, 3, 1, 8)
  # The kernels divide q'.k' by sqrt of its width, 2K = 8.
  got = np.einsum("lhk,sk->hls", np.asarray(q2[0], np.float64), np.asarray(k2[0, :, 0])) / 8**0.5
  want = np.zeros_like(got)
  for h in range(2):
    for i, t in enumerate((7, 9)):
      for j, s in enumerate((2, 7, 8)):
        want[h, i, j] = score_by_hand(q[0, i, h], k[0, j, 0], t, s, delta[0])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Negative control: without the sqrt(2) of the queries the logits are off by that factor.
  assert np.abs(got / math.sqrt(2) - want).max() > 0.05


def test_dense_kernel_attends_with_the_papers_logits():
  # A query at 5 over keys at 1, 3, 5: softmax of the hand logits, times the values.
  pe = make(num_heads=1)
  delta = np.array([[-0.5, -3.0, 0.0, -2 * math.pi]])
  pe.delta[...] = jnp.asarray(delta, jnp.float32)
  q, k, v = normal(2, (1, 1, 1, 4)), normal(3, (1, 3, 1, 4)), normal(4, (1, 3, 1, 4))
  qpos, kpos = pos([5]), pos([1, 3, 5])
  q2, k2 = pe.rotate(q, k, qpos, kpos)
  got = kernels.dense_attention(q2, k2, v, qpos, kpos, AttentionCall(causal=True))
  assert got.shape == (1, 1, 1, 4)  # as wide as the values
  logits = np.array([score_by_hand(q[0, 0, 0], k[0, j, 0], 5, s, delta[0]) for j, s in
                     enumerate((1, 3, 5))])  # fmt: skip
  p = np.exp(logits - logits.max())
  want = (p / p.sum()) @ np.asarray(v[0, :, 0], np.float64)
  np.testing.assert_allclose(np.asarray(got)[0, 0, 0], want, rtol=1e-5, atol=1e-6)


def test_scores_depend_only_on_the_offset():
  pe = make(num_heads=2, num_kv_heads=2, head_dim=8, pope_bias_init="uniform")
  q, k = normal(5, (1, 4, 2, 8)), normal(6, (1, 4, 2, 8))
  qpos_L, kpos_L = np.array([3, 4, 9, 20]), np.array([0, 3, 4, 9])

  def scores(shift_q, shift_k):
    q2, k2 = pe.rotate(q, k, pos(qpos_L + shift_q), pos(kpos_L + shift_k))
    return np.einsum("blhk,bshk->hls", np.asarray(q2, np.float64), np.asarray(k2, np.float64))

  base = scores(0, 0)
  for shift in (1, 37, 1000):
    # float32 angles at positions near 1000 are off by ~1e-4 rad.
    np.testing.assert_allclose(scores(shift, shift), base, atol=2e-3)
  # Negative control: moving the keys one position further changes the scores.
  assert np.abs(scores(0, 1) - base).max() > 0.05


def test_features_keep_float32_angles_for_bfloat16_inputs():
  # At position 65,537 a bfloat16 angle would be off by whole turns.
  x = normal(7, (1, 1, 1, 4))
  p = 65_537
  got = np.asarray(pope_features(x.astype(jnp.bfloat16), pos([p]), pope_frequencies(4)), np.float64)
  mu = softplus(np.asarray(x.astype(jnp.bfloat16), np.float64))[0, 0, 0]
  angle = p * 10000.0 ** (-np.arange(4) / 4)
  want = np.concatenate([mu * np.cos(angle), mu * np.sin(angle)])
  np.testing.assert_allclose(got[0, 0, 0], want, atol=0.03)


def test_the_phase_bias_is_per_key_head_and_reaches_only_its_query_heads():
  # 4 query heads, 2 key heads: query heads 0, 1 read key head 0; 2, 3 read key head 1.
  pe = make(num_heads=4, num_kv_heads=2)
  q, k = normal(8, (1, 2, 4, 4)), normal(9, (1, 2, 2, 4))
  qpos = kpos = pos([0, 3])

  def logits():
    q2, k2 = pe.rotate(q, k, qpos, kpos)
    k2_BSHK = jnp.repeat(k2, 2, axis=2)
    return np.asarray(jnp.einsum("blhk,bshk->hls", q2, k2_BSHK))

  before = logits()
  pe.delta[...] = pe.delta[...].at[1].set(-1.5)
  after = logits()
  np.testing.assert_array_equal(after[:2], before[:2])
  assert np.abs(after[2:] - before[2:]).max(axis=(1, 2)).min() > 1e-3
  with pytest.raises(ValueError, match="model.num_kv_heads"):
    pe.rotate(q, jnp.repeat(k, 2, axis=2), qpos, kpos)


# ---- The bias's range ----


def test_constrain_clamps_the_phase_bias_into_minus_two_pi_to_zero():
  pe = make(num_kv_heads=2)
  pe.delta[...] = jnp.asarray([[0.7, -0.2, -7.0, -2 * math.pi], [3.0, 0.0, -TWO_PI - 1e-3, -1.0]])
  pe.constrain()
  np.testing.assert_allclose(
    np.asarray(pe.delta[...]),
    [[0.0, -0.2, -TWO_PI, -TWO_PI], [0.0, 0.0, -TWO_PI, -1.0]],
    rtol=1e-6,
  )


def test_the_forward_pass_reads_the_clamp_with_the_gradient_of_the_bias():
  q, k = normal(10, (1, 2, 1, 4)), normal(11, (1, 2, 1, 4))
  qpos = kpos = pos([0, 5])

  def loss(pe):
    q2, k2 = pe.rotate(q, k, qpos, kpos)
    return jnp.sum(q2[:, :, :, None] * k2[:, None])

  outside, at_bound = make(num_heads=1), make(num_heads=1)
  outside.delta[...] = jnp.asarray([[1.0, -9.0, -1.0, 0.5]])
  at_bound.delta[...] = jnp.asarray([[0.0, -TWO_PI, -1.0, 0.0]])
  np.testing.assert_allclose(loss(outside), loss(at_bound), rtol=1e-6)
  # Straight through: a bias past its bound keeps the gradient it has at the bound (not 0).
  g_out, g_bound = (np.asarray(nnx.grad(loss)(pe).delta[...]) for pe in (outside, at_bound))
  np.testing.assert_allclose(g_out, g_bound, rtol=1e-5)
  assert np.abs(g_out).min() > 0


def test_bias_initialisation_is_zeros_or_uniform_in_minus_two_pi_to_zero():
  np.testing.assert_array_equal(np.asarray(make(num_kv_heads=2).delta[...]), np.zeros((2, 4)))
  delta = np.asarray(make(num_kv_heads=16, head_dim=16, pope_bias_init="uniform").delta[...])
  assert delta.shape == (16, 16) and delta.min() >= -TWO_PI and delta.max() <= 0.0
  assert delta.min() < -5.5 and delta.max() > -0.7  # spread over the interval


# ---- Configuration ----


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(pope_bias_init="normal"), r"posenc.pope_bias_init='normal' is not one of"),
    (dict(scaling=RopeScaling(kind="yarn", factor=2.0)), r"posenc.scaling.kind='yarn' applies"),
    (dict(extension=ContextExtension(kind="rerope", window=4)), "posenc.extension.kind='rerope'"),
    (dict(rope_fraction=0.5), r"posenc.rope_fraction=0.5 applies to the rotary encodings"),
    (dict(rope_truncate=0.25), "posenc.rope_truncate"),
    (dict(max_wavelength=1.0), "posenc.max_wavelength=1.0 must be > 1"),
  ],
)
def test_settings_pope_cannot_honour_are_refused_naming_the_field(fields, message):
  with pytest.raises(ValueError, match=message):
    posenc.validate_posenc(PosEncConfig(kind="pope", **fields), causal=True, head_dim=8)


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(attention="linear"), "model.attention='linear' does not support"),
    (dict(attention="mla", kv_lora_rank=8, qk_rope_head_dim=4, num_kv_heads=0),
     "model.attention='mla' does not support"),
  ],
)  # fmt: skip
def test_linear_and_latent_attention_refuse_pope(fields, message):
  with pytest.raises(ValueError, match=message):
    testing.tiny_model_config("pope", **fields)


def test_a_run_config_with_pope_loads_and_validates_its_field():
  config = testing.tiny_config({"posenc.kind": "pope", "posenc.pope_bias_init": "uniform"})
  run_config = config_lib.run_config_from_dict(config)
  assert run_config.model.posenc.pope_bias_init == "uniform"
  config.posenc.pope_bias_init = "ones"
  with pytest.raises(ValueError, match="posenc.pope_bias_init='ones'"):
    config_lib.run_config_from_dict(config)


# ---- Kernels, model, training, generation ----


def _kernel_case(window=0):
  pe = make(num_heads=4, num_kv_heads=2, head_dim=4, pope_bias_init="uniform")
  B, L = 2, 19  # not a multiple of the block
  q, k, v = normal(12, (B, L, 4, 4)), normal(13, (B, L, 2, 4)), normal(14, (B, L, 2, 4))
  p = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32) + 100, (B, L))
  seg = (jnp.arange(L)[None] >= jnp.array([[11], [4]])).astype(jnp.int32)
  q2, k2 = pe.rotate(q, k, p, p)
  kwargs = dict(qseg_BL=seg, kseg_BS=seg, causal=True, window=window, block=4)
  return q2, k2, v, p, kwargs


@pytest.mark.parametrize("window", [0, 5], ids=["chunked", "banded"])
def test_chunked_and_banded_kernels_equal_dense_in_outputs_and_gradients(window):
  q2, k2, v, p, kwargs = _kernel_case(window)

  @functools.partial(jax.jit, static_argnums=0)
  def outputs_and_grads(kernel, q2, k2, v):
    def loss(q2, k2, v):
      o = kernel(q2, k2, v, p, p, AttentionCall(**kwargs))
      return jnp.sum(o * jnp.sin(jnp.arange(o.size).reshape(o.shape))), o

    (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q2, k2, v)
    return o, grads

  o_dense, g_dense = outputs_and_grads(kernels.dense_attention, q2, k2, v)
  o_chunk, g_chunk = outputs_and_grads(kernels.chunked_attention, q2, k2, v)
  assert o_dense.shape == v.shape[:2] + (4, 4)
  np.testing.assert_allclose(o_chunk, o_dense, atol=1e-5)
  for name, a, b in zip(("q", "k", "v"), g_chunk, g_dense, strict=True):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
  if window:  # the windowed path is the banded kernel: it must differ from full attention
    full = kernels.dense_attention(q2, k2, v, p, p, AttentionCall(**{**kwargs, "window": 0}))
    assert np.abs(np.asarray(full) - np.asarray(o_dense)).max() > 1e-3


@pytest.mark.parametrize("fields", [{}, dict(attention_window=3)], ids=["full", "window"])
def test_model_logits_of_the_chunked_kernel_equal_dense(fields):
  cfg = testing.tiny_model_config("pope", attention_impl="dense", **fields)
  dense = testing.random_model(cfg)
  # Blocks of 2: with the window, the banded kernel (3 of 6 key blocks visited).
  chunked = testing.random_model(dataclasses.replace(cfg, attention_impl="chunked",
                                                     attention_block=2))  # fmt: skip
  tokens, p = testing.random_tokens(2, 11), testing.arange_positions(2, 11, start=50)
  want = testing.forward(dense, tokens, p)
  np.testing.assert_allclose(testing.forward(chunked, tokens, p), want, atol=1e-5)


def _batch(rng, batch_size, length):
  tokens = rng.integers(0, ByteTokenizer.vocab_size, (batch_size, length + 1)).astype(np.int32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "positions": np.tile(np.arange(length, dtype=np.int32), (batch_size, 1)),
    "weights": np.ones((batch_size, length), np.float32),
  }


def test_a_pope_decoder_trains_a_step_clamps_its_bias_and_evaluates_at_twice_its_length():
  seq_len = 16
  cfg = ModelConfig(
    num_layers=1, emb_dim=16, num_heads=4, num_kv_heads=2, mlp_dim=32, attention_impl="dense",
    posenc=PosEncConfig(kind="pope"),
  )  # fmt: skip
  model = make_model(cfg, rngs=nnx.Rngs(0))
  assert model.layers[0].attn.init_cache(1, 8).k_BCGK.shape == (1, 8, 2, 8)  # keys are 2K
  model.posenc.delta[...] = model.posenc.delta[...].at[0, 0].set(-9.0)  # outside [-2 pi, 0]
  optim = OptimConfig(learning_rate=1e-2, warmup_steps=0)
  tx = optimizer.make_optimizer(optim, 10, decay_posenc=posenc.POSENCS["pope"].decays_parameters)
  model_def, model_state = nnx.split(model)
  opt_def, opt_state = nnx.split(nnx.Optimizer(model, tx, wrt=nnx.Param))
  step = functools.partial(
    step_lib.train_step, model_def=model_def, opt_def=opt_def,
    schedule=optimizer.make_schedule(optim, 10), seed=0, grad_accum_steps=1,
  )  # fmt: skip
  batch = _batch(np.random.default_rng(0), 8, seq_len)
  model_state, _, metrics = jax.jit(step)(model_state, opt_state, batch, jnp.int32(0))
  assert np.isfinite(float(metrics["loss_sum"])) and bool(metrics["params_finite"])
  stepped = nnx.merge(model_def, model_state)
  delta = np.asarray(stepped.posenc.delta[...])
  # The train step's `constrain`: the bias pushed past -2 pi sits at -2 pi, and from zeros
  # Adam's first step (+-lr) leaves it at 0 (clamped) or -0.01: every entry moved or was held.
  assert delta[0, 0] == pytest.approx(-TWO_PI)
  assert delta.min() >= -TWO_PI and delta.max() <= 0.0
  assert np.sum(delta < -1e-3) > 1 and np.sum(delta == 0.0) > 1
  # Evaluation at twice the training length, through the evaluation path.
  tokens = np.random.default_rng(1).integers(32, 127, 400).astype(np.int32)
  result = perplexity.evaluate_at_length(
    stepped, tokens, length=2 * seq_len, protocol="nonoverlapping", stride=2 * seq_len,
    max_tokens=128, max_length=2 * seq_len, batch_size=4,
  )  # fmt: skip
  assert np.isfinite(result["loss"]) and result["tokens"] == 128


def test_a_layer_pattern_mixes_pope_and_nope_layers():
  cfg = testing.tiny_model_config(
    "pope", {"layer_pattern": "pope,nope"}, num_layers=3, attention_window_pattern="3,0",
    attention_impl="chunked", attention_block=2,
  )  # fmt: skip
  model = testing.random_model(cfg)
  kinds = [type(model.posenc.layer(i)).__name__ for i in range(3)]
  assert kinds == ["Pope", "NoPE", "Pope"]
  caches = model.init_caches(1, 9)
  assert all(isinstance(c, KVCache) for c in caches)
  assert [c.k_BCGK.shape[-1] for c in caches] == [8, 4, 8]  # PoPE layers cache 2K-wide keys
  assert all(c.v_BCGK.shape[-1] == 4 for c in caches)
  # The PoPE layers read positions, the NoPE layer does not.
  x = normal(15, (2, 7, 16))
  p = testing.arange_positions(2, 7)
  out = [
    [np.asarray(model.layers[i](x, q, model.posenc.layer(i))[0]) for q in (p, 3 * p)]
    for i in range(2)
  ]
  assert not np.allclose(*out[0], atol=1e-4)
  np.testing.assert_allclose(*out[1], atol=1e-6)
