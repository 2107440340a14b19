"""RoFormer models: Encoder (masked LM) and Decoder (causal LM), their blocks and heads.

Dimension legend: B batch, L length, D model dim (emb_dim), E embedding dim (encoder
embedding_size), H heads, K head dim, F MLP dim, V vocab.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.nn.attention.kinds import ATTENTIONS, make_attention
from roformer.nn.attention.primitives import dropout as _dropout
from roformer.nn.attention.softmax import attention_dropout
from roformer.nn.config import (
  MODEL_KINDS,
  REMAT_POLICIES,
  ModelConfig,
  resolve_embed_scale,
  resolve_head_dim,
  resolve_num_kv_heads,
)
from roformer.nn.layer_spec import LayerSpec
from roformer.nn.layers import DTYPES, stacked_dense, swiglu
from roformer.nn.layers import embed as _embed
from roformer.nn.layers import linear as _linear
from roformer.nn.layers import norm as _norm
from roformer.nn.layers import tokens as _tokens
from roformer.nn.seqwise import fold, seqwise
from roformer.posenc import POSENCS, PosEnc, make_posenc
from roformer.posenc.layers import has_pattern


def make_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> "Encoder | Decoder":
  """The Encoder or Decoder `cfg` describes (validated when it was built).

  Parameters carry logical axis names. Under a mesh (`jax.set_mesh` with logical axis rules) they
  are created sharded; without one they are created unsharded on the default device.
  """
  with nnx.use_eager_sharding(not jax.sharding.get_abstract_mesh().empty):
    return MODELS[cfg.kind](cfg, rngs=rngs)


# ---- Models ----

# Dropout sites fold their index into the forward pass's key: the embeddings, then layer i with
# _FIRST_LAYER + i; inside a block, the attention probabilities, the attention output and the MLP.
_EMBED, _FIRST_LAYER = 0, 1
_ATTN, _OUT, _MLP = 0, 1, 2


class _Model(nnx.Module):
  """The forward pass the Encoder and the Decoder share: embeddings, blocks, final norm, head.

  A model defines `_embed` (tokens to the first block's input), `_final` (the last block's
  output to the final hidden states) and `logits` (its head).
  """

  def __call__(self, tokens_BL, positions_BL, **kwargs):
    """Float32 logits [B, L, V]; arguments as `hidden`."""
    return self.logits(self.hidden(tokens_BL, positions_BL, **kwargs))

  def hidden(
    self,
    tokens_BL,
    positions_BL,
    *,
    segment_ids_BL=None,
    token_type_ids_BL=None,
    deterministic: bool = True,
    rngs: nnx.Rngs | None = None,
  ):
    """Final hidden states [B, L, D] in the compute dtype, before the head.

    Args:
      tokens_BL: int32 token ids.
      positions_BL: int32 positions (restarting per packed document).
      segment_ids_BL: int32 document ids; tokens attend only within their id. None = one document.
      token_type_ids_BL: int32 token types (encoders with model.type_vocab_size > 0; None = all 0).
      deterministic: False enables dropout, which needs `rngs=nnx.Rngs(dropout=key)`.
      rngs: dropout keys.
    """
    cfg = self.cfg
    _check_inputs(tokens_BL, positions_BL, segment_ids_BL, token_type_ids_BL, cfg)
    key = _dropout_key(cfg, deterministic, rngs)
    x_BLD = self._embed(tokens_BL, positions_BL, token_type_ids_BL, fold(key, _EMBED))
    x_BLD, _ = _run_layers(
      self, x_BLD, positions_BL, self.posenc.prepare(positions_BL),
      segment_ids_BL=segment_ids_BL, key=key,
    )  # fmt: skip
    return self._final(x_BLD)

  def _token_embeddings(self, tokens_BL, positions_BL, token_type_ids_BL=None):
    """Scaled token embeddings (+ token types) plus the encoding's, in the compute dtype."""
    x_BLE = self.embed(tokens_BL) * self.embed_multiplier
    if token_type_ids_BL is not None:
      x_BLE = x_BLE + self.token_type_embed(token_type_ids_BL)
    return self.posenc.embed(x_BLE, positions_BL).astype(DTYPES[self.cfg.dtype])


class Encoder(_Model):
  """Bidirectional masked-LM Transformer laid out as HF RoFormerForMaskedLM.

  Embeddings (word [+ token type] + posenc.embed) -> LayerNorm -> dropout -> optional projection
  E -> D -> post-LN blocks (pre-LN with `pre_norm`, then a final norm) -> MLM head
  (dense D -> E, gelu, LayerNorm, decoder tied to the word embeddings, plus a bias).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    E = cfg.embedding_size or cfg.emb_dim
    self.embed, self.embed_multiplier = _token_embed(cfg, E, rngs)
    self.token_type_embed = (
      _embed(cfg, cfg.type_vocab_size, E, rngs) if cfg.type_vocab_size else None
    )
    self.posenc = _model_posenc(cfg, E, causal=False, rngs=rngs)
    self.embed_norm = _norm(cfg, E, rngs)
    self.embed_project = (
      _linear(cfg, E, cfg.emb_dim, (None, "embed"), rngs) if E != cfg.emb_dim else None
    )
    self.layers = _make_layers(cfg, causal=False, pre_norm=cfg.pre_norm, rngs=rngs)
    self.final_norm = _norm(cfg, cfg.emb_dim, rngs) if cfg.pre_norm else None
    self.head_dense = _linear(cfg, cfg.emb_dim, E, ("embed", None), rngs)
    self.head_norm = _norm(cfg, E, rngs)
    self.head_decoder = (
      None
      if cfg.tie_embeddings
      else _linear(cfg, E, cfg.vocab_size, ("embed", "vocab"), rngs, False)
    )
    bias_init = nnx.with_partitioning(nnx.initializers.zeros, ("vocab",))
    self.head_bias = nnx.Param(bias_init(rngs.params(), (cfg.vocab_size,), DTYPES[cfg.param_dtype]))

  def _embed(self, tokens_BL, positions_BL, token_type_ids_BL, key):
    cfg = self.cfg
    if self.token_type_embed is not None and token_type_ids_BL is None:
      token_type_ids_BL = jnp.zeros_like(tokens_BL)
    x_BLE = self._token_embeddings(tokens_BL, positions_BL, token_type_ids_BL)

    def embed_tail(key, x_BLE):
      return _dropout(self.embed_norm(x_BLE), cfg.dropout_rate, key)

    x_BLE = seqwise(embed_tail, x_BLE, block=cfg.attention_block, key=key)
    # E -> D has no intermediate wider than its [B, L, D] output, so it needs no blocks.
    return x_BLE if self.embed_project is None else self.embed_project(x_BLE)

  def _final(self, x_BLD):
    if self.final_norm is None:
      return x_BLD
    return seqwise(lambda _, x: self.final_norm(x), x_BLD, block=self.cfg.attention_block)

  def logits(self, h_BLD):
    """MLM head: hidden [B, L, D] -> float32 logits [B, L, V]."""
    # HF RoFormer uses the model's hidden_act here; a swiglu model falls back to gelu.
    t_NE = self.head_norm(jax.nn.gelu(self.head_dense(_tokens(h_BLD)), approximate=False))
    logits_NV = self.embed.attend(t_NE) if self.head_decoder is None else self.head_decoder(t_NE)
    logits_NV = logits_NV.astype(jnp.float32) + self.head_bias[...].astype(jnp.float32)[None]
    return logits_NV.reshape(*h_BLD.shape[:2], -1)


class Decoder(_Model):
  """Causal LM: embeddings (+ posenc.embed) -> pre-LN blocks -> final norm -> LM head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed, self.embed_multiplier = _token_embed(cfg, cfg.emb_dim, rngs)
    self.posenc = _model_posenc(cfg, cfg.emb_dim, causal=True, rngs=rngs)
    self.layers = _make_layers(cfg, causal=True, pre_norm=True, rngs=rngs)
    self.final_norm = _norm(cfg, cfg.emb_dim, rngs)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else _linear(cfg, cfg.emb_dim, cfg.vocab_size, ("embed", "vocab"), rngs, use_bias=False)
    )

  def _embed(self, tokens_BL, positions_BL, token_type_ids_BL, key):
    del token_type_ids_BL  # refused by _check_inputs: decoders have no token types
    x_BLD = self._token_embeddings(tokens_BL, positions_BL)
    return _dropout(x_BLD, self.cfg.dropout_rate, key)

  def _final(self, x_BLD):
    return seqwise(lambda _, x: self.final_norm(x), x_BLD, block=self.cfg.attention_block)

  def init_caches(self, batch: int, max_len: int) -> list:
    """Empty decoding caches of every layer for sequences of up to `max_len` tokens."""
    return [layer.attn.init_cache(batch, max_len) for layer in self.layers]

  def decode(self, tokens_BL, positions_BL, caches, rotary_state):
    """The forward pass of L new tokens over the caches: (float32 logits [B, L, V], caches).

    The same path as `hidden` (no dropout), with every layer's cache (`init_caches`). Positions
    run 0, 1, 2, ... in every row and L > 1 is the prefill of empty caches (`roformer.generate`);
    `rotary_state` is `posenc.prepare` of the whole generation.
    """
    x_BLD = self._embed(tokens_BL, positions_BL, None, None)
    x_BLD, caches = _run_layers(self, x_BLD, positions_BL, rotary_state, caches=caches)
    return self.logits(self._final(x_BLD)), caches

  def logits(self, h_BLD):
    """LM head: hidden [B, L, D] -> float32 logits [B, L, V]."""
    h_ND = _tokens(h_BLD)
    logits_NV = self.embed.attend(h_ND) if self.lm_head is None else self.lm_head(h_ND)
    return logits_NV.astype(jnp.float32).reshape(*h_BLD.shape[:2], -1)


MODELS = dict(zip(MODEL_KINDS, (Encoder, Decoder), strict=True))


def _make_layers(cfg: ModelConfig, *, causal: bool, pre_norm: bool, rngs: nnx.Rngs):
  """num_layers Blocks: a list (each with its window), or with `scan_layers` one Block whose
  parameters are stacked.

  Stacked parameters get a leading [num_layers] axis that is never sharded (logical name None).
  """
  # The model's kind decides causality (an Encoder built from a decoder's config stays one).
  specs = [dataclasses.replace(spec, causal=causal) for spec in cfg.layers]
  if not cfg.scan_layers:
    return nnx.List([Block(cfg, spec, pre_norm=pre_norm, rngs=rngs) for spec in specs])

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(
    in_axes=(0,),
    out_axes=0,
    axis_size=cfg.num_layers,
    transform_metadata={nnx.PARTITION_NAME: None},
  )
  def stacked(rngs):
    # Stacked layers are alike (a ModelConfig with scan_layers refuses per-layer patterns).
    return Block(cfg, specs[0], pre_norm=pre_norm, rngs=rngs)

  return stacked(rngs)


def _run_layers(model, x_BLD, positions_BL, rotary_state, *, segment_ids_BL=None, key=None,
                caches=None):  # fmt: skip
  """Runs the blocks in order (a Python loop, or lax.scan over stacked ones), with remat.

  One rotary state (`PosEnc.prepare`) serves every layer of the pass. With `caches` (one per
  layer, `Decoder.init_caches`) each block reads and writes its own; returns (x, caches).
  """
  cfg, posenc = model.cfg, model.posenc
  policy = REMAT_POLICIES[cfg.remat]

  def run(graphdef, state, x_BLD, i, cache, layer_posenc, layer_state):
    layer = nnx.merge(graphdef, state)
    return layer(
      x_BLD,
      positions_BL,
      layer_posenc,
      cache=cache,
      segment_ids_BL=segment_ids_BL,
      dropout_key=fold(key, _FIRST_LAYER + i),
      rotary_state=layer_state,
    )

  if policy is not None:
    run = jax.checkpoint(run, policy=policy, static_argnums=(0,))
  if not cfg.scan_layers:
    new_caches = []
    for i, layer in enumerate(model.layers):
      # A per-layer pattern (posenc.layer_pattern) gives layer i its own encoding and state.
      x_BLD, cache = run(
        *nnx.split(layer), x_BLD, i, None if caches is None else caches[i], posenc.layer(i),
        posenc.layer_state(rotary_state, i),
      )  # fmt: skip
      new_caches.append(cache)
    return x_BLD, None if caches is None else new_caches
  if caches is not None:
    raise ValueError(
      "model.scan_layers=True stacks the layers into one block, which has no per-layer caches"
    )
  graphdef, state = nnx.split(model.layers)

  def body(x_BLD, state_and_index):
    state, i = state_and_index
    return run(graphdef, state, x_BLD, i, None, posenc, rotary_state)[0], None

  x_BLD, _ = jax.lax.scan(body, x_BLD, (state, jnp.arange(cfg.num_layers)))
  return x_BLD, None


# ---- Blocks ----


class Block(nnx.Module):
  """Attention + MLP sublayers with residuals; post-LN (BERT/RoFormer) or pre-LN, sequential or
  (`model.parallel_residual`, pre-LN only) parallel: x + attn(norm1(x)) + mlp(norm2(x)).

  The output projection and the MLP run over sequence blocks of `cfg.attention_block` when L is
  longer, updating the residual stream in place, so the forward pass's activation memory stays
  O(L * D), not O(L * F). (Under gradients the loop's backward pass keeps every block's MLP
  activations, [L / C, C, F] a layer, unless `model.remat` recomputes them: the largest buffers
  of `tpu_compile.py --memory_report`.) The q/k/v projections run over the whole sequence:
  their outputs are [B, L, ...] anyway and they have no wider intermediate.
  """

  def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, pre_norm: bool, rngs: nnx.Rngs):
    """Layer `spec.index` of the model `cfg`: its encoding, window and QK-norm are `spec`'s."""
    self.pre_norm = pre_norm
    self.parallel_residual = cfg.parallel_residual
    self.dropout_rate = cfg.dropout_rate
    self.seq_block = cfg.attention_block
    self.attn_norm = _norm(cfg, cfg.emb_dim, rngs)
    self.attn = make_attention(cfg, spec, rngs=rngs)
    self.mlp_norm = _norm(cfg, cfg.emb_dim, rngs)
    self.mlp = Mlp(cfg, rngs=rngs)
    # An encoding with parameters per layer (CoPE, FIRE): this layer's own instance.
    self.posenc = (
      _posenc(cfg, cfg.emb_dim, causal=spec.causal, rngs=rngs, posenc_cfg=spec.posenc)
      if POSENCS[spec.posenc.kind].per_layer(spec.posenc)
      else None
    )

  def __call__(
    self, x_BLD, pos_BL, posenc, *, cache=None, segment_ids_BL=None, dropout_key=None,
    rotary_state=None,
  ):  # fmt: skip
    """x [B, L, D] at positions [B, L] -> ([B, L, D], cache); `dropout_key` None = no dropout.

    `cache` is this layer's attention cache during generation (None otherwise; see the
    attention kind's `__call__`). `rotary_state` is `posenc.prepare` of the whole pass (None:
    prepared from `pos_BL`); a layer with an encoding of its own (`self.posenc`) uses that
    instead of the model's `posenc`.
    """
    o_BLHK, cache = self.attn(
      self.attn_norm(x_BLD) if self.pre_norm else x_BLD,
      pos_BL,
      posenc if self.posenc is None else self.posenc,
      cache=cache,
      segment_ids_BL=segment_ids_BL,
      dropout_key=fold(dropout_key, _ATTN),
      rotary_state=rotary_state,
    )
    x_BLD = seqwise(self._out_and_mlp, o_BLHK, x_BLD, block=self.seq_block, key=dropout_key)
    return x_BLD, cache

  def _out_and_mlp(self, key, o_BLHK, x_BLD):
    # Over the tokens as one axis (layers.tokens); dropout draws the same masks either way.
    o_NHK, x_ND = _tokens(o_BLHK), _tokens(x_BLD)
    if self.parallel_residual:
      # Both branches read the block's input; validation guarantees pre-LN here.
      attn_ND = _dropout(self.attn.out(o_NHK), self.dropout_rate, fold(key, _OUT))
      mlp_ND = _dropout(self.mlp(self.mlp_norm(x_ND)), self.dropout_rate, fold(key, _MLP))
      return (x_ND + attn_ND + mlp_ND).reshape(x_BLD.shape)
    x_ND = x_ND + _dropout(self.attn.out(o_NHK), self.dropout_rate, fold(key, _OUT))
    if not self.pre_norm:
      x_ND = self.attn_norm(x_ND)
    h_ND = self.mlp_norm(x_ND) if self.pre_norm else x_ND
    x_ND = x_ND + _dropout(self.mlp(h_ND), self.dropout_rate, fold(key, _MLP))
    return (x_ND if self.pre_norm else self.mlp_norm(x_ND)).reshape(x_BLD.shape)


class Mlp(nnx.Module):
  """Position-wise MLP: up D -> F, gelu (exact erf) or swiglu (silu(gate) * up), down F -> D."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, F = cfg.emb_dim, cfg.mlp_dim
    self.activation = cfg.activation
    self.up = _linear(cfg, D, F, ("embed", "mlp"), rngs)
    self.gate = _linear(cfg, D, F, ("embed", "mlp"), rngs) if cfg.activation == "swiglu" else None
    self.down = _linear(cfg, F, D, ("mlp", "embed"), rngs)

  def __call__(self, x_ND):
    """x [N, D] (the tokens as one axis) -> [N, D]."""
    if self.gate is None:
      return self.down(jax.nn.gelu(self.up(x_ND), approximate=False))
    # gate and up as one GEMM (`stacked_dense`), the gated activation in one pass (`swiglu`).
    gate_NF, up_NF = stacked_dense(x_ND, (self.gate, self.up))
    return self.down(swiglu(gate_NF, up_NF))


# ---- Helpers ----


def _model_posenc(cfg, emb_dim, *, causal, rngs):
  """The model's encoding; for one with parameters per layer (`PosEnc.per_layer`) a
  parameter-free instance whose `embed` and `prepare` are the identity, as that encoding's are."""
  per_layer = not has_pattern(cfg.posenc) and POSENCS[cfg.posenc.kind].per_layer(cfg.posenc)
  return _posenc(cfg, emb_dim, causal=causal, rngs=rngs, build=PosEnc if per_layer else None)


def _posenc(cfg, emb_dim, *, causal, rngs, build=None, posenc_cfg=None):
  """`make_posenc` for the model config (validated, the registry's class), or `build(...)`;
  `posenc_cfg` (one layer's) replaces the model's `cfg.posenc`."""
  return (build or make_posenc)(
    posenc_cfg or cfg.posenc,
    num_heads=cfg.num_heads,
    head_dim=ATTENTIONS[cfg.attention].rotary_head_dim(cfg, resolve_head_dim(cfg)),
    emb_dim=emb_dim,
    causal=causal,
    num_kv_heads=resolve_num_kv_heads(cfg),
    param_dtype=DTYPES[cfg.param_dtype],
    embed_init_std=emb_dim**-0.5 if resolve_embed_scale(cfg) == "sqrt_d" else 0.02,
    rngs=rngs,
  )


def _token_embed(cfg, dim, rngs):
  """The word embedding and the multiplier of its output (`model.embed_scale`).

  "none" is BERT's N(0, 0.02^2) table read as is. "sqrt_d" is Vaswani et al.'s and fairseq's
  N(0, 1/E) table multiplied by sqrt(E), so token vectors have unit variance per dimension, as
  large as a sinusoidal table added to them; a tied output layer reads the unscaled table.
  """
  if resolve_embed_scale(cfg) == "sqrt_d":
    return _embed(cfg, cfg.vocab_size, dim, rngs, stddev=dim**-0.5), float(math.sqrt(dim))
  return _embed(cfg, cfg.vocab_size, dim, rngs), 1.0


def _check_inputs(tokens_BL, positions_BL, segment_ids_BL, token_type_ids_BL, cfg):
  if tokens_BL.ndim != 2 or positions_BL.shape != tokens_BL.shape:
    raise ValueError(
      f"tokens and positions must both be [B, L]; got {tokens_BL.shape} and {positions_BL.shape}"
    )
  if segment_ids_BL is not None and segment_ids_BL.shape != tokens_BL.shape:
    raise ValueError(f"segment_ids {segment_ids_BL.shape} do not match tokens {tokens_BL.shape}")
  if token_type_ids_BL is not None and not cfg.type_vocab_size:
    raise ValueError("token_type_ids were given but model.type_vocab_size=0")


def _dropout_key(cfg, deterministic, rngs):
  """One key for the whole forward pass (None: no dropout); sites fold in their own index."""
  if deterministic or (cfg.dropout_rate == 0.0 and attention_dropout(cfg) == 0.0):
    return None
  if rngs is None:
    raise ValueError(
      f"deterministic=False with model.dropout_rate={cfg.dropout_rate} (attention: "
      f"{attention_dropout(cfg)}) needs rngs=nnx.Rngs(dropout=key)"
    )
  return rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs
