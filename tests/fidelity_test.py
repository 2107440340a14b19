"""Each encoding as its paper ran it: embedding scale, weight decay, causal-only encodings, the
xPos span, blockwise causal attention, centred encoder windows, packed evaluation, RoPE factors."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from roformer import config as config_lib
from roformer import data, runs
from roformer.data import windows as data_windows
from roformer.evals import plots, ppl_vs_length, spec
from roformer.nn.attention import kernels as attention
from roformer.nn.attention import primitives
from roformer.nn.attention.call import AttentionCall
from roformer.nn.config import ModelConfig, resolve_embed_scale, unsupported_length
from roformer.nn.model import make_model
from roformer.posenc import POSENCS, sinusoidal_embedding
from roformer.posenc.config import PosEncConfig
from roformer.posenc.rope import xpos_max_span
from roformer.train import optimizer

D = 64


def _model(kind="decoder", posenc="sinusoidal", **fields):
  cfg = ModelConfig(
    kind=kind, num_layers=1, emb_dim=D, num_heads=2, mlp_dim=64, posenc=PosEncConfig(kind=posenc)
  )
  return make_model(ModelConfig(**{**cfg.__dict__, **fields}), rngs=nnx.Rngs(0))


# ---- Embedding scale ----


@pytest.mark.parametrize(
  ("posenc", "scale"),
  [
    ("sinusoidal", "sqrt_d"),
    ("alibi", "sqrt_d"),
    ("t5", "sqrt_d"),
    ("xpos", "sqrt_d"),
    ("nope", "sqrt_d"),
    ("learned", "none"),
    ("rope", "none"),
  ],
)
def test_auto_embed_scale_is_the_encodings_paper(posenc, scale):
  assert resolve_embed_scale(ModelConfig(posenc=PosEncConfig(kind=posenc))) == scale
  assert POSENCS[posenc].paper_embed_scale == scale


def test_sinusoidal_tokens_are_as_large_as_the_position_table():
  # Vaswani et al. multiply N(0, 1/d) embeddings by sqrt(d); with BERT's 0.02 table the unit
  # sinusoids outweighed the tokens ~35 to 1.
  model = _model(posenc="sinusoidal")
  tokens_1V = jnp.arange(200)[None]
  token_norm = float(
    jnp.linalg.norm(model.embed(tokens_1V) * model.embed_multiplier, axis=-1).mean()
  )
  table_norm = float(jnp.linalg.norm(sinusoidal_embedding(tokens_1V, D), axis=-1).mean())
  assert model.embed_multiplier == pytest.approx(math.sqrt(D))
  assert token_norm == pytest.approx(math.sqrt(D), rel=0.1)  # unit variance per dimension
  assert 0.5 < table_norm / token_norm < 1.0  # sqrt(d / 2) against sqrt(d)


def test_embed_scale_none_keeps_berts_table_and_sqrt_d_overrides_any_encoding():
  bert = _model(posenc="learned")
  assert bert.embed_multiplier == 1.0
  assert float(jnp.std(bert.embed.embedding[...])) == pytest.approx(0.02, rel=0.1)
  scaled = _model(posenc="rope", embed_scale="sqrt_d")
  assert float(jnp.std(scaled.embed.embedding[...])) == pytest.approx(D**-0.5, rel=0.1)
  # The hidden states see the scaled tokens: same weights, multiplier 1 gives other outputs.
  tokens_BL = jnp.arange(8)[None]
  pos_BL = jnp.arange(8)[None]
  unscaled = nnx.clone(scaled)
  unscaled.embed_multiplier = 1.0
  assert not np.allclose(scaled(tokens_BL, pos_BL), unscaled(tokens_BL, pos_BL), atol=1e-3)


def test_embed_scale_rejects_unknown_values():
  with pytest.raises(ValueError, match="model.embed_scale='big' is not one of"):
    ModelConfig(embed_scale="big")


# ---- Weight decay ----


def test_position_tables_get_weight_decay_only_as_their_papers_did():
  # T5 trains its bias table without decay; BERT decays its learned table like any other.
  for posenc, decayed in (("t5", False), ("learned", True)):
    model = _model(posenc=posenc)
    decay = POSENCS[posenc].decays_parameters
    assert decay == decayed
    mask = optimizer.decay_mask(nnx.state(model, nnx.Param), decay_posenc=decay)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["['posenc']['table'].value"] == decayed
    assert not flat["['layers'][0]['attn']['query']['bias'].value"]  # [H, K], still a bias
    assert flat["['layers'][0]['attn']['query']['kernel'].value"]
    assert flat["['embed']['embedding'].value"]


def test_learned_table_is_initialised_like_the_tokens():
  assert float(jnp.std(_model(posenc="learned").posenc.table[...])) == pytest.approx(0.02, rel=0.1)
  fairseq = _model(posenc="learned", embed_scale="sqrt_d")
  assert float(jnp.std(fairseq.posenc.table[...])) == pytest.approx(D**-0.5, rel=0.1)


# ---- Causal-only encodings ----


def test_nope_encoder_is_refused_as_a_bag_of_words():
  with pytest.raises(ValueError, match="posenc.kind='nope' needs a causal decoder"):
    _model(kind="encoder", posenc="nope")
  assert POSENCS["nope"].causal_only and POSENCS["xpos"].causal_only
  assert not POSENCS["rope"].causal_only
  _model(kind="decoder", posenc="nope")


# ---- xPos span ----


def test_xpos_refuses_spans_its_float32_scales_cannot_hold():
  cfg = PosEncConfig(kind="xpos")
  limit = xpos_max_span(cfg)
  assert 60_000 < limit < 72_000  # the defaults (gamma 0.4, scale_base 512)
  decoder = ModelConfig(posenc=cfg)
  assert unsupported_length(decoder, limit) is None
  assert re.search(
    "exceeds the .* positions posenc.kind='xpos' can scale", unsupported_length(decoder, limit + 2)
  )
  # At the limit the largest query scale is finite; well past it, it overflows.
  model = _model(posenc="xpos")
  for span, finite in ((limit, True), (int(1.2 * limit), False)):
    kpos_1S = jnp.arange(span)[None]
    log_zeta = jnp.asarray(model.posenc.log_zeta())
    c = (span - 1) // 2
    top = jnp.exp((0 - c) / model.posenc.cfg.xpos_scale_base * log_zeta) * 1e3
    assert bool(jnp.all(jnp.isfinite(top))) == finite, span
    if not finite:
      with pytest.raises(ValueError, match="xpos"):
        model.posenc.scales(kpos_1S, kpos_1S, model.posenc.prepare(kpos_1S))


# ---- Blockwise causal attention (xPos) ----


def test_blockwise_window_sees_its_half_block_and_the_previous_one():
  pos_1L = jnp.arange(12)[None]
  mask_LS = np.asarray(
    primitives.attention_mask(pos_1L, pos_1L, causal=True, window=8, window_kind="blockwise")[0]
  )
  # Blocks of 4: query 9 (block 2, 8..11) sees keys 4..9; query 7 (block 1) sees 0..7, as does
  # every query of an input no longer than the window.
  np.testing.assert_array_equal(np.flatnonzero(mask_LS[9]), np.arange(4, 10))
  np.testing.assert_array_equal(np.flatnonzero(mask_LS[7]), np.arange(0, 8))
  np.testing.assert_array_equal(np.flatnonzero(mask_LS[11]), np.arange(4, 12))
  assert max(i - np.flatnonzero(row).min() for i, row in enumerate(mask_LS)) < 8
  sliding = np.asarray(primitives.attention_mask(pos_1L, pos_1L, causal=True, window=4)[0])
  np.testing.assert_array_equal(np.flatnonzero(sliding[9]), np.arange(6, 10))


def test_blockwise_window_kernels_agree():
  key = jax.random.key(0)
  q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (2, 40, 2, 8)) for i in range(3))
  pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
  kw = dict(causal=True, window=8, window_kind="blockwise")
  dense = attention.dense_attention(q, k, v, pos, pos, AttentionCall(**kw))
  chunked = attention.chunked_attention(q, k, v, pos, pos, AttentionCall(block=16, **kw))
  np.testing.assert_allclose(chunked, dense, atol=1e-5)
  full = attention.dense_attention(q, k, v, pos, pos, AttentionCall(causal=True))
  assert not np.allclose(dense, full, atol=1e-3)


def test_eval_labels_xpos_without_bca_honestly():
  xpos = ModelConfig(posenc=PosEncConfig(kind="xpos"))
  assert ppl_vs_length.label_notes(xpos, trained_window=0, stride=0, protocols=("sliding",)) == [
    "no BCA",
    "stride L/4",
  ]
  bca = runs.eval_model_config(xpos, seq_len=64, attention_window=64, window_kind="blockwise")
  assert ppl_vs_length.label_notes(
    bca, trained_window=0, stride=1, protocols=("nonoverlapping",)
  ) == ["BCA 64"]
  label = plots.run_label("run", {"posenc": "xpos", "notes": ["no BCA"]})
  assert label == "run (xpos, no BCA)"
  assert spec.output_name(spec.EvalSpec(window=64, bca=True), seq_len=32) == "ppl_vs_length_bca64"


# ---- RoPE scaling factor per length ----


def test_auto_rope_factor_is_target_over_training_length():
  assert spec.parse_rope_factor("auto") == "auto"
  assert spec.factor_at("auto", 512, 128) == 4.0
  assert spec.factor_at("auto", 64, 128) == 1.0
  assert spec.factor_at(2.0, 512, 128) == 2.0
  yarn_auto = spec.EvalSpec(rope=spec.RopeOverride("yarn", "auto"))
  assert spec.output_name(yarn_auto, seq_len=128) == "ppl_vs_length_yarn_auto"
  with pytest.raises(ValueError, match="--rope_factor must be a number or 'auto'"):
    spec.parse_rope_factor("fast")
  with pytest.raises(ValueError, match="--rope_factor must be a number or 'auto'"):
    spec.RopeOverride("yarn", "fast")


def test_original_max_len_defaults_to_the_init_from_runs_length(tmp_path):
  source = tmp_path / "short_run"
  source.mkdir()
  (source / "config.json").write_text(json.dumps({"data": {"seq_len": 64}}))
  config = default.get_config()
  config.data.seq_len = 256
  config.posenc.scaling.kind = "linear"
  config.posenc.scaling.factor = 4.0
  config.train.init_from = str(source)
  assert config_lib.run_config_from_dict(config).model.posenc.scaling.original_max_len == 64
  config.train.init_from = str(source / "checkpoints" / "700")
  (source / "checkpoints" / "700").mkdir(parents=True)
  assert config_lib.run_config_from_dict(config).model.posenc.scaling.original_max_len == 64
  config.train.init_from = ""
  assert config_lib.run_config_from_dict(config).model.posenc.scaling.original_max_len == 256


# ---- Encoder windows: context on both sides ----


def test_centred_sliding_windows_give_scored_tokens_context_on_both_sides():
  tokens = np.random.default_rng(0).integers(0, 256, 4000).astype(np.int32)
  length, stride, before = 32, 8, (32 - 8) // 2  # 12 tokens before the scored 8, 12 after
  w = data.eval_windows(
    tokens, length=length, protocol="sliding", stride=stride, max_tokens=256, max_length=64,
    model_kind="encoder", tokenizer=data.ByteTokenizer(), mlm_probability=0.5,
  )  # fmt: skip
  # Window i covers the span's targets [64 + 8i, 64 + 8i + 8) in its middle columns.
  np.testing.assert_array_equal(w.target_indices[:, before], 64 + stride * np.arange(256 // stride))
  np.testing.assert_array_equal(w.targets, tokens[w.target_indices])
  cols = np.flatnonzero(w.weights.any(axis=0))
  assert cols.min() == before and length - 1 - cols.max() == length - stride - before
  assert w.target_indices.max() < len(tokens)


def test_encoder_eval_masks_the_same_tokens_at_every_length_and_protocol():
  from roformer.data.tokenizer import ByteTokenizer

  tokenizer = ByteTokenizer()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, 6000).astype(np.int32)
  masked = set()
  for length, protocol in ((16, "nonoverlapping"), (64, "sliding"), (32, "sliding")):
    w = data.eval_windows(
      tokens, model_kind="encoder", length=length, protocol=protocol, stride=length // 4,
      max_tokens=512, max_length=64, tokenizer=tokenizer, seed=3,
    )  # fmt: skip
    masked.add(tuple(sorted(set(w.target_indices[w.weights > 0].tolist()))))
  assert len(masked) == 1


# ---- Packed runs ----


def test_packed_evaluation_restarts_positions_and_segments_after_eos():
  eos = 9
  inputs = np.array([[1, 2, eos, 3, 4, eos, eos, 5]])
  segments, positions = data_windows.document_segments(inputs, eos)
  np.testing.assert_array_equal(segments, [[0, 0, 0, 1, 1, 1, 2, 3]])
  np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 0, 0]])
