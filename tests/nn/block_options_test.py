"""Tests of the block options that imported decoders need and training can use too:
`model.qkv_bias` (Qwen2) and `model.parallel_residual` (GPT-NeoX / Pythia)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.model import make_model


def _param_names(cfg):
  model = nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))
  return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _layer_norm(x, norm, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * norm.scale[...][None, None] + norm.bias[...][None, None]


def _dense(x, layer):
  return x @ layer.kernel[...] + layer.bias[...][None, None]


# ---- qkv_bias ----


def test_qkv_bias_gives_query_key_value_biases_and_no_other():
  names = _param_names(testing.tiny_model_config(use_bias=False, qkv_bias=True))
  biases = {n for n in names if n.endswith("bias") and "norm" not in n}  # LayerNorm's own
  assert biases == {f"layers.{i}.attn.{p}.bias" for i in (0, 1) for p in ("query", "key", "value")}


def test_qkv_bias_changes_logits_and_receives_gradients():
  cfg = testing.tiny_model_config(use_bias=False, qkv_bias=True)
  model = testing.random_model(cfg)
  tokens, pos = testing.random_tokens(2, 8), testing.arange_positions(2, 8)

  def loss(model):
    return jnp.mean(model(tokens, pos) ** 2)

  grads = nnx.grad(loss)(model)
  # The value bias reaches the logits through the attention output, the key bias only through
  # the softmax (a key bias shifts every score of a query by the same q.b_k: no gradient).
  grad_q = np.asarray(grads.layers[0].attn.query.bias[...])
  grad_v = np.asarray(grads.layers[0].attn.value.bias[...])
  assert np.abs(grad_q).max() > 1e-6 and np.abs(grad_v).max() > 1e-6
  # The same model with its biases set to zero computes other logits.
  zeroed = nnx.clone(model)
  for layer in zeroed.layers:
    for proj in (layer.attn.query, layer.attn.key, layer.attn.value):
      proj.bias[...] = jnp.zeros_like(proj.bias[...])
  diff = jnp.abs(testing.forward(model, tokens, pos) - testing.forward(zeroed, tokens, pos))
  assert float(diff.max()) > 1e-3


# ---- parallel_residual ----


def test_parallel_residual_block_is_x_plus_attention_plus_mlp_of_the_same_input():
  cfg = testing.tiny_model_config(num_layers=1, parallel_residual=True, norm_eps=0.01)
  model = testing.random_model(cfg)
  tokens, pos = testing.random_tokens(2, 10), testing.arange_positions(2, 10)

  @jax.jit
  def hidden_and_formula(model):
    eps, layer = cfg.norm_eps, model.layers[0]
    x = model.embed.embedding[...][tokens]
    o_BLHK, _ = layer.attn(_layer_norm(x, layer.attn_norm, eps), pos, model.posenc)
    mlp_in = _layer_norm(x, layer.mlp_norm, eps)
    mlp = _dense(jax.nn.gelu(_dense(mlp_in, layer.mlp.up), approximate=False), layer.mlp.down)
    h = x + layer.attn.out(o_BLHK) + mlp
    return model.hidden(tokens, pos), _layer_norm(h, model.final_norm, eps)

  got, want = hidden_and_formula(model)
  np.testing.assert_allclose(got, want, atol=1e-4)
  # The sequential block of the same parameters computes something else.
  sequential = nnx.merge(
    nnx.graphdef(make_model(testing.tiny_model_config(num_layers=1, norm_eps=0.01),
                            rngs=nnx.Rngs(0))),
    nnx.state(model),
  )  # fmt: skip
  assert float(jnp.abs(sequential.hidden(tokens, pos) - got).max()) > 1e-3


@pytest.mark.parametrize(
  "fields", [dict(parallel_residual=True), dict(use_bias=False, qkv_bias=True)]
)
def test_cached_generation_equals_full_forward_passes_with_the_option(fields):
  testing.check_cached_generation(testing.tiny_model_config(**fields))


def test_parallel_residual_blockwise_equals_unblocked():
  cfg = testing.tiny_model_config(parallel_residual=True, attention_impl="chunked")
  small = testing.random_model(dataclasses.replace(cfg, attention_block=4))
  whole = testing.random_model(cfg)
  tokens, pos = testing.random_tokens(2, 12), testing.arange_positions(2, 12)
  np.testing.assert_allclose(
    testing.forward(small, tokens, pos), testing.forward(whole, tokens, pos), atol=1e-5
  )


# ---- Validation ----

BAD = [
  (dict(qkv_bias=True), "model.qkv_bias=True .* model.use_bias=True"),
  (dict(kind="encoder", parallel_residual=True), "model.parallel_residual=True needs pre-LN"),
  (
    dict(attention="mla", kv_lora_rank=8, qk_rope_head_dim=4, use_bias=False, qkv_bias=True),
    "model.qkv_bias=True .* model.attention='mla'",
  ),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_a_bad_combination_is_refused_naming_the_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    testing.tiny_model_config(**fields)


def test_parallel_residual_encoder_with_pre_norm_is_accepted():
  cfg = testing.tiny_model_config(
    "rope", kind="encoder", pre_norm=True, parallel_residual=True, num_kv_heads=0
  )
  assert cfg.parallel_residual
