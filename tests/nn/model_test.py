"""Tests for roformer/nn/model.py: structure, invariances, causality, packing, errors, dtypes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.nn.config import ModelConfig, unsupported_length
from roformer.nn.model import Decoder, Encoder, make_model
from roformer.posenc import POSENCS
from roformer.posenc.config import PosEncConfig

V = 64
SMALL = ModelConfig(
  kind="decoder", vocab_size=V, num_layers=2, emb_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64
)


def _cfg(kind="decoder", posenc="rope", **kwargs):
  posenc_cfg = PosEncConfig(kind=posenc, max_len=kwargs.pop("max_len", 128))
  return dataclasses.replace(SMALL, kind=kind, posenc=posenc_cfg, **kwargs)


def _model(cfg, seed=0):
  """make_model's structure with random values in every parameter (biases and norms included).

  Tracing the constructor and filling the values from numpy avoids compiling every initializer
  on CPU; nonzero biases and norm parameters also exercise every parameter in the tests.
  """
  graphdef, state = nnx.split(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    name = path[-2].key  # the last entry is the Variable's `.value`
    noise = rng.standard_normal(x.shape).astype(np.float32)
    if name == "scale":
      value = 1.0 + 0.1 * noise
    elif name in ("bias", "head_bias"):
      value = 0.1 * noise
    elif name == "kernel":  # fan-in: all but the output axis of out [H, K, D], else the first
      value = noise / np.sqrt(
        np.prod(x.shape[:-1]) if x.ndim == 3 and x.shape[-1] == cfg.emb_dim else x.shape[0]
      )
    else:  # embedding tables, posenc tables
      value = 0.5 * noise
    return jnp.asarray(value, x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def _tokens(batch, length, seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, (batch, length)), jnp.int32)


def _arange(batch, length, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


@jax.jit
def _logits(model, tokens, positions, segment_ids=None):
  return model(tokens, positions, segment_ids_BL=segment_ids)


def _param_shapes(model):
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return {".".join(map(str, path)): tuple(var.shape) for path, var in flat}


# ---- Structure ----


def test_encoder_param_tree_follows_hf_roformer_layout():
  cfg = _cfg(
    "encoder", embedding_size=16, type_vocab_size=2, num_kv_heads=0, num_layers=1, activation="gelu"
  )
  shapes = _param_shapes(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))))
  assert shapes == {
    "embed.embedding": (V, 16),  # embeddings.word_embeddings
    "token_type_embed.embedding": (2, 16),  # embeddings.token_type_embeddings
    "embed_norm.scale": (16,),  # embeddings.LayerNorm
    "embed_norm.bias": (16,),
    "embed_project.kernel": (16, 32),  # embeddings_project
    "embed_project.bias": (32,),
    "layers.0.attn.query.kernel": (32, 4, 8),  # attention.self.query, [D, H, K]
    "layers.0.attn.query.bias": (4, 8),
    "layers.0.attn.key.kernel": (32, 4, 8),
    "layers.0.attn.key.bias": (4, 8),
    "layers.0.attn.value.kernel": (32, 4, 8),
    "layers.0.attn.value.bias": (4, 8),
    "layers.0.attn.out.kernel": (4, 8, 32),  # attention.output.dense, [H, K, D]
    "layers.0.attn.out.bias": (32,),
    "layers.0.attn_norm.scale": (32,),  # attention.output.LayerNorm (post-LN)
    "layers.0.attn_norm.bias": (32,),
    "layers.0.mlp.up.kernel": (32, 64),  # intermediate.dense
    "layers.0.mlp.up.bias": (64,),
    "layers.0.mlp.down.kernel": (64, 32),  # output.dense
    "layers.0.mlp.down.bias": (32,),
    "layers.0.mlp_norm.scale": (32,),  # output.LayerNorm
    "layers.0.mlp_norm.bias": (32,),
    "head_dense.kernel": (32, 16),  # cls.predictions.transform.dense
    "head_dense.bias": (16,),
    "head_norm.scale": (16,),  # cls.predictions.transform.LayerNorm
    "head_norm.bias": (16,),
    "head_bias": (V,),  # cls.predictions.bias; the decoder is tied to embed.embedding
  }


def test_decoder_param_tree_and_logical_axes():
  cfg = _cfg(posenc="t5", num_layers=1, activation="swiglu", norm="rmsnorm", tie_embeddings=False)
  model = nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))
  assert isinstance(model, Decoder)
  assert _param_shapes(model) == {
    "embed.embedding": (V, 32),
    "posenc.table": (4, 32),
    "layers.0.attn_norm.scale": (32,),
    "layers.0.attn.query.kernel": (32, 4, 8),
    "layers.0.attn.query.bias": (4, 8),
    "layers.0.attn.key.kernel": (32, 2, 8),
    "layers.0.attn.key.bias": (2, 8),
    "layers.0.attn.value.kernel": (32, 2, 8),
    "layers.0.attn.value.bias": (2, 8),
    "layers.0.attn.out.kernel": (4, 8, 32),
    "layers.0.attn.out.bias": (32,),
    "layers.0.mlp_norm.scale": (32,),
    "layers.0.mlp.up.kernel": (32, 64),
    "layers.0.mlp.up.bias": (64,),
    "layers.0.mlp.gate.kernel": (32, 64),
    "layers.0.mlp.gate.bias": (64,),
    "layers.0.mlp.down.kernel": (64, 32),
    "layers.0.mlp.down.bias": (32,),
    "final_norm.scale": (32,),
    "lm_head.kernel": (32, V),
  }
  layer = model.layers[0]
  assert layer.attn.query.kernel.out_sharding == ("embed", "heads", "kv")
  assert layer.attn.out.kernel.out_sharding == ("heads", "kv", "embed")
  assert layer.mlp.up.kernel.out_sharding == ("embed", "mlp")
  assert model.embed.embedding.out_sharding == ("vocab", "embed")
  assert model.lm_head.kernel.out_sharding == ("embed", "vocab")


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_make_model_builds_abstractly_for_every_posenc(kind):
  # Restoring a checkpoint or a sharded init builds the model under nnx.eval_shape / jit.
  for posenc in tuple(POSENCS):
    if kind == "encoder" and POSENCS[posenc].causal_only:
      continue
    cfg = _cfg(kind, posenc)
    model = nnx.eval_shape(lambda cfg=cfg: make_model(cfg, rngs=nnx.Rngs(0)))
    assert model.posenc.cfg.kind == posenc


def test_make_model_initialises_float32_params_and_finite_logits():
  model = make_model(_cfg(num_layers=1), rngs=nnx.Rngs(0))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(p.dtype == jnp.float32 for p in params)
  assert float(jnp.abs(model.layers[0].attn.query.kernel[...]).max()) > 0
  logits = _logits(model, _tokens(2, 8), _arange(2, 8))
  assert logits.shape == (2, 8, V) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_encoder_mlm_head_is_tied_to_word_embeddings():
  model = _model(_cfg("encoder", embedding_size=16))

  @jax.jit
  def logits_and_manual(model, tokens, pos):
    h = model.hidden(tokens, pos)
    t = model.head_norm(jax.nn.gelu(model.head_dense(h), approximate=False))
    return model.logits(h), t @ model.embed.embedding[...].T + model.head_bias[...][None, None]

  got, want = logits_and_manual(model, _tokens(2, 8), _arange(2, 8))
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert model.head_decoder is None
  untied = nnx.eval_shape(
    lambda: make_model(_cfg("encoder", tie_embeddings=False), rngs=nnx.Rngs(0))
  )
  assert untied.head_decoder.kernel.shape == (32, V)


def _layer_norm(x, norm, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * norm.scale[...][None, None] + norm.bias[...][None, None]


def _rms_norm(x, norm, eps):
  return x / jnp.sqrt((x**2).mean(-1, keepdims=True) + eps) * norm.scale[...][None, None]


def _dense(x, linear):
  return x @ linear.kernel[...] + linear.bias[...][None, None]


def test_encoder_hidden_matches_post_ln_bert_formula():
  cfg = _cfg("encoder", embedding_size=16, type_vocab_size=2, num_layers=1)
  model = _model(cfg)
  tokens, pos = _tokens(2, 10), _arange(2, 10)
  types = jnp.asarray(np.random.default_rng(3).integers(0, 2, (2, 10)), jnp.int32)

  @jax.jit
  def hidden_and_formula(model):
    eps, layer = cfg.norm_eps, model.layers[0]
    e = model.embed.embedding[...][tokens] + model.token_type_embed.embedding[...][types]
    x = _dense(_layer_norm(e, model.embed_norm, eps), model.embed_project)
    h = _layer_norm(x + layer.attn.out(layer.attn(x, pos, model.posenc)[0]), layer.attn_norm, eps)
    mlp = _dense(jax.nn.gelu(_dense(h, layer.mlp.up), approximate=False), layer.mlp.down)
    return model.hidden(tokens, pos, token_type_ids_BL=types), _layer_norm(
      h + mlp, layer.mlp_norm, eps
    )

  got, want = hidden_and_formula(model)
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_decoder_hidden_matches_pre_ln_formula():
  cfg = _cfg("decoder", num_layers=1, norm="rmsnorm", activation="swiglu", norm_eps=0.01)
  model = _model(cfg)
  tokens, pos = _tokens(2, 10), _arange(2, 10)

  @jax.jit
  def hidden_and_formula(model):
    eps, layer = cfg.norm_eps, model.layers[0]
    x = model.embed.embedding[...][tokens]
    o_BLHK, _ = layer.attn(_rms_norm(x, layer.attn_norm, eps), pos, model.posenc)
    h = x + layer.attn.out(o_BLHK)
    g = _rms_norm(h, layer.mlp_norm, eps)
    mlp = _dense(jax.nn.silu(_dense(g, layer.mlp.gate)) * _dense(g, layer.mlp.up), layer.mlp.down)
    return model.hidden(tokens, pos), _rms_norm(h + mlp, model.final_norm, eps)

  got, want = hidden_and_formula(model)
  np.testing.assert_allclose(got, want, atol=1e-4)


# ---- Positions, causality, packing ----

INVARIANT = {"rope": True, "xpos": True, "alibi": True, "t5": True, "nope": True}


@pytest.mark.parametrize("posenc", ["rope", "xpos", "alibi", "t5", "nope", "sinusoidal", "learned"])
def test_decoder_logits_under_position_shift_invariant_only_for_relative_encodings(posenc):
  model = _model(_cfg(posenc=posenc, max_len=2048))
  tokens = jnp.tile(_tokens(1, 16), (2, 1))
  pos = _arange(2, 16) + jnp.array([[0], [1000]], jnp.int32)
  logits = _logits(model, tokens, pos)
  diff = float(jnp.abs(logits[0] - logits[1]).max())
  if INVARIANT.get(posenc, False):
    assert diff < 1e-4
  else:
    assert diff > 1e-2


@pytest.mark.parametrize(
  ("impl", "block"), [("dense", 4), pytest.param("chunked", 4, marks=pytest.mark.slow)]
)
def test_decoder_gradients_zero_after_current_token(impl, block):
  length = 10
  model = _model(_cfg(posenc="t5", attention_impl=impl, attention_block=block))
  tokens = jnp.asarray(np.random.default_rng(0).permutation(V)[None, :length], jnp.int32)
  graphdef, state = nnx.split(model)

  projection = jnp.asarray(np.random.default_rng(1).standard_normal((length, 32)), jnp.float32)

  def projected_hidden(embedding):  # [L]: output t projected on a random direction
    def swap(path, x):
      return (
        embedding if [getattr(k, "key", None) for k in path[:2]] == ["embed", "embedding"] else x
      )

    m = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(swap, state))
    return jnp.sum(m.hidden(tokens, _arange(1, length))[0] * projection, axis=-1)

  jac = jax.jit(jax.jacrev(projected_hidden))(model.embed.embedding[...])  # [L, V, D]
  # Tokens are distinct, so row tokens[s] of the table reaches the outputs only through input s.
  sensitivity = jnp.abs(jac[:, tokens[0], :]).sum(axis=-1)  # [t, s]
  future = np.triu(np.ones((length, length), bool), k=1)
  assert float(sensitivity[future].max()) == 0.0
  assert float(sensitivity[~future].min()) > 0.0


PACKED_CASES = [
  ("decoder", "rope", "dense", 512),
  pytest.param("decoder", "xpos", "chunked", 8, marks=pytest.mark.slow),
  ("encoder", "t5", "chunked", 8),
  pytest.param("encoder", "learned", "auto", 512, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("kind", "posenc", "impl", "block"), PACKED_CASES)
def test_packed_documents_equal_documents_run_apart(kind, posenc, impl, block):
  model = _model(_cfg(kind, posenc, attention_impl=impl, attention_block=block))
  len_a, len_b = 9, 15
  tokens = _tokens(1, len_a + len_b)
  segments = jnp.asarray([[1] * len_a + [2] * len_b], jnp.int32)
  positions = jnp.concatenate([_arange(1, len_a), _arange(1, len_b)], axis=1)

  # Run apart as one batch: document A padded to the length of B with its own segment id 0.
  pad = len_b - len_a
  apart_tokens = jnp.concatenate(
    [jnp.pad(tokens[:, :len_a], ((0, 0), (0, pad))), tokens[:, len_a:]]
  )
  apart_segments = jnp.asarray([[1] * len_a + [0] * pad, [1] * len_b], jnp.int32)
  apart_positions = jnp.concatenate(
    [jnp.pad(_arange(1, len_a), ((0, 0), (0, pad))), _arange(1, len_b)]
  )

  @jax.jit
  def run(model):
    packed = model(tokens, positions, segment_ids_BL=segments)
    return packed, model(apart_tokens, apart_positions, segment_ids_BL=apart_segments)

  packed, apart = run(model)
  np.testing.assert_allclose(packed[0, :len_a], apart[0, :len_a], atol=1e-4)
  np.testing.assert_allclose(packed[0, len_a:], apart[1], atol=1e-4)


@pytest.mark.parametrize(
  "cfg",
  [
    _cfg("decoder", "t5", activation="swiglu", norm="rmsnorm"),
    _cfg("encoder", "rope", embedding_size=16, type_vocab_size=2),
    pytest.param(
      _cfg("encoder", "sinusoidal", pre_norm=True, num_kv_heads=1), marks=pytest.mark.slow
    ),
  ],
  ids=["decoder", "encoder", "encoder_pre_norm"],
)
def test_blockwise_hidden_equals_unblocked_hidden(cfg):
  length = 21  # > attention_block, and not a multiple of it
  blocked = _model(dataclasses.replace(cfg, attention_block=8))
  whole = _model(dataclasses.replace(cfg, attention_block=64, attention_impl="dense"))
  tokens, pos = _tokens(2, length), _arange(2, length)
  hidden = jax.jit(lambda m: m.hidden(tokens, pos))
  np.testing.assert_allclose(hidden(blocked), hidden(whole), atol=1e-5)


def test_blockwise_gradients_equal_unblocked_gradients():
  # L is not a multiple of the block, so the shifted last block's rows already written must pass
  # their gradients through unchanged. (test_chunked_gradients_match_dense covers the kernel.)
  cfg = _cfg("encoder", "alibi", num_layers=1, pre_norm=True)
  length = 21
  blocked = _model(dataclasses.replace(cfg, attention_block=8, attention_impl="dense"))
  whole = _model(dataclasses.replace(cfg, attention_block=64, attention_impl="dense"))
  tokens, pos = _tokens(2, length), _arange(2, length)
  projection = jnp.asarray(np.random.default_rng(2).standard_normal((2, length, 32)), jnp.float32)

  @jax.jit
  def grads(model):
    return jax.grad(lambda m: jnp.sum(m.hidden(tokens, pos) * projection))(model)

  want, got = jax.tree.leaves(grads(whole)), jax.tree.leaves(grads(blocked))
  assert len(got) == len(want) >= 15
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, float(jnp.abs(w).max())))


# ---- Dtypes, dropout ----


@pytest.mark.parametrize("kind", ["decoder", pytest.param("encoder", marks=pytest.mark.slow)])
def test_bfloat16_compute_runs_with_float32_params_and_stays_close(kind):
  f32 = _model(_cfg(kind))
  bf16 = _model(_cfg(kind, dtype="bfloat16"))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
  tokens, pos = _tokens(2, 12), _arange(2, 12)
  run = jax.jit(lambda a, b: (a(tokens, pos), b(tokens, pos), b.hidden(tokens, pos)))
  want, got, hidden = run(f32, bf16)
  assert got.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
  scale = float(jnp.abs(want).max())
  assert float(jnp.abs(got - want).max()) < 0.05 * scale


def test_dropout_needs_keys_and_is_reproducible_per_key():
  model = _model(_cfg("encoder", dropout_rate=0.2, num_layers=1))
  tokens, pos = _tokens(2, 12), _arange(2, 12)
  with pytest.raises(ValueError, match="rngs"):
    model(tokens, pos, deterministic=False)

  @jax.jit
  def train_logits(model, key):
    return model(tokens, pos, deterministic=False, rngs=nnx.Rngs(dropout=key))

  a, b = train_logits(model, jax.random.key(0)), train_logits(model, jax.random.key(1))
  np.testing.assert_array_equal(train_logits(model, jax.random.key(0)), a)
  assert float(jnp.abs(a - b).max()) > 1e-3
  assert float(jnp.abs(a - _logits(model, tokens, pos)).max()) > 1e-3


# ---- Bad input ----

BAD_CONFIGS = [
  (dict(posenc="bogus"), "posenc.kind"),
  (dict(emb_dim=28), "model.head_dim=7"),  # rope rotates pairs of dims
  (
    dict(emb_dim=48, num_heads=6, num_kv_heads=4),
    "model.num_heads=6 is not divisible by model.num_kv_heads=4",
  ),
  (dict(kind="encoder", posenc="xpos"), "posenc.kind='xpos'"),
  (dict(kind="bogus"), "model.kind='bogus' is not one of \\['encoder', 'decoder'\\]"),
  (dict(activation="relu"), "model.activation='relu' is not one of \\['gelu', 'swiglu'\\]"),
  (dict(norm="batchnorm"), "model.norm='batchnorm' is not one of \\['layernorm', 'rmsnorm'\\]"),
  (dict(dtype="float16"), "model.dtype='float16' is not one of \\['float32', 'bfloat16'\\]"),
  (dict(attention_impl="flash"), "model.attention_impl='flash' is not one of"),
  (dict(emb_dim=30), "model.emb_dim=30 is not divisible by model.num_heads=4"),
  (dict(embedding_size=16), "model.embedding_size"),
  (dict(type_vocab_size=2), "model.type_vocab_size"),
  (dict(num_layers=0), "model.num_layers"),
  (dict(dropout_rate=1.0), "model.dropout_rate"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_CONFIGS)
def test_a_bad_config_is_refused_when_built_naming_the_field(fields, message):
  # A ModelConfig validates itself once, when built; make_model then trusts it.
  with pytest.raises(ValueError, match=message):
    _cfg(**fields)


def test_learned_positions_past_max_len_raise_value_error():
  cfg = _cfg("encoder", "learned", max_len=16)
  assert unsupported_length(cfg, 16) is None
  assert "posenc.max_len=16" in unsupported_length(cfg, 17)
  model = _model(cfg)
  assert isinstance(model, Encoder)
  with pytest.raises(ValueError, match="posenc.max_len=16"):
    jax.eval_shape(lambda: model(_tokens(1, 17), _arange(1, 17)))


# ---- Memory ----


@pytest.mark.slow
def test_blockwise_hidden_activation_memory_is_linear_in_length():
  length, mlp_dim = 4096, 8192
  cfg = _cfg(emb_dim=64, mlp_dim=mlp_dim, num_layers=2, attention_block=256)
  model = nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
  compiled = jax.jit(lambda m, t: m.hidden(t, t)).lower(model, tokens).compile()
  one_mlp_activation = length * mlp_dim * 4
  assert compiled.memory_analysis().temp_size_in_bytes < one_mlp_activation / 4


@pytest.mark.parametrize(("kernel", "most"), [("XLA kernels", 5), ("cpu_flash", 6)])
def test_blockwise_hidden_memory_grows_by_a_few_sequence_buffers_whatever_the_depth(
  monkeypatch, kernel, most
):
  # Temp memory per token is a few float32 [D] vectors in all (the residual stream, q/k/v, the
  # blocked key copies), not a few per layer: every layer writes its blocks in place. The fused
  # CPU kernel's operands and results (q, k, v, o and the log-sum-exp) are buffers of their own,
  # about one more in all.
  from roformer.nn.attention.kernels import cpu_flash

  if kernel == "cpu_flash":
    assert cpu_flash.unavailable() is None  # the kernel this case measures runs here
  else:
    monkeypatch.setattr(cpu_flash, "unavailable", lambda: "the XLA kernels")
  emb_dim, length = 64, 512

  def buffers_per_length(num_layers):
    cfg = _cfg(emb_dim=emb_dim, mlp_dim=4 * emb_dim, num_layers=num_layers, attention_block=128)
    model = nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))

    def temp_bytes(length):
      tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
      compiled = jax.jit(lambda m, t: m.hidden(t, t)).lower(model, tokens).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    return (temp_bytes(4 * length) - temp_bytes(length)) / (3 * length * emb_dim * 4)

  # Before the in-place blocks this was about 6 per layer (about 10 here); it is about 4 now.
  two, four = buffers_per_length(2), buffers_per_length(4)
  assert two < most
  assert abs(four - two) < 0.25  # not per layer


# ---- Scanned layers, rematerialisation, bfloat16 compute ----


def _stacked_like_unrolled(unrolled, scan_cfg):
  """A scan_layers model holding `unrolled`'s parameters, its blocks stacked on a leading axis."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: make_model(scan_cfg, rngs=nnx.Rngs(0))))
  values = nnx.state(unrolled).to_pure_dict()
  blocks = [values["layers"][i] for i in range(scan_cfg.num_layers)]
  values["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
  nnx.replace_by_pure_dict(state, values)
  return nnx.merge(graphdef, state)


@pytest.mark.parametrize(
  "kind, remat, fields",
  [
    ("encoder", "none", {}),
    ("decoder", "full", {}),
    ("decoder", "block", dict(attention_sinks=True)),  # stacked sinks [layers, H]
    ("decoder", "full", dict(forget_gate=True)),  # stacked gates
  ],
)
def test_scan_layers_matches_unrolled_blocks_with_dropout(kind, remat, fields):
  cfg = _cfg(kind, num_layers=3, dropout_rate=0.2, attention_impl="dense", **fields)
  unrolled = _model(cfg)
  scanned = _stacked_like_unrolled(
    unrolled, dataclasses.replace(cfg, scan_layers=True, remat=remat)
  )
  tokens, positions = _tokens(2, 12), _arange(2, 12)

  def logits(model):
    return model(tokens, positions, deterministic=False, rngs=nnx.Rngs(dropout=3))

  def loss(model):
    return jnp.sum(jnp.sin(logits(model)))

  expected = logits(unrolled)
  atol = 1e-5 * float(np.abs(expected).max())
  np.testing.assert_allclose(logits(scanned), expected, rtol=1e-5, atol=atol)
  grads_u, grads_s = nnx.grad(loss)(unrolled), nnx.grad(loss)(scanned)
  stacked_u = _stacked_like_unrolled(nnx.merge(nnx.graphdef(unrolled), grads_u), scanned.cfg)
  for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(nnx.state(stacked_u)), strict=True):
    # float32 sums in another order: errors relative to the leaf's largest entry.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("remat", ["block", "full"])
def test_remat_leaves_gradients_unchanged(remat):
  cfg = _cfg("decoder", attention_impl="dense")
  model = _model(cfg)
  rematted = nnx.merge(
    nnx.graphdef(_model(dataclasses.replace(cfg, remat=remat))), nnx.state(model)
  )
  tokens, positions = _tokens(2, 12), _arange(2, 12)
  loss = lambda m: jnp.sum(jnp.sin(m(tokens, positions)))  # noqa: E731
  expected, got = nnx.grad(loss)(model), nnx.grad(loss)(rematted)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_compute_keeps_float32_parameters_and_gradients():
  cfg = _cfg("encoder", attention_impl="dense")
  model32 = _model(cfg)
  model16 = nnx.merge(
    nnx.graphdef(_model(dataclasses.replace(cfg, dtype="bfloat16"))), nnx.state(model32)
  )
  tokens, positions = _tokens(2, 12), _arange(2, 12)
  assert model16.hidden(tokens, positions).dtype == jnp.bfloat16
  loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens, positions))[..., 0])  # noqa: E731
  grads = nnx.grad(loss)(model16)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model16, nnx.Param))} == {
    jnp.dtype(jnp.float32)
  }
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  # bfloat16 keeps ~3 significant digits; float32 softmax and norms keep the loss close.
  np.testing.assert_allclose(loss(model16), loss(model32), rtol=2e-2)
