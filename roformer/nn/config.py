"""The model's configuration: ModelConfig, its validation, and what follows from its fields.

Validated once, when a ModelConfig is built; the model and the library trust one that exists.
"""

import copy
import dataclasses
import functools

import jax

from roformer.nn.attention.kernels import KERNELS
from roformer.nn.attention.kinds import ATTENTIONS
from roformer.nn.attention.primitives import WINDOW_KINDS
from roformer.nn.attention.qk_norm import QK_NORMS
from roformer.nn.layer_spec import LayerSpec, layer_specs
from roformer.nn.layers import DTYPES
from roformer.posenc import POSENCS, layer_configs, validate_posenc
from roformer.posenc.config import PosEncConfig
from roformer.posenc.layers import has_pattern, int_list, kind_list, parse_error, pattern_kinds

MODEL_KINDS = ("encoder", "decoder")  # masked LM, causal LM
ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
EMBED_SCALES = ("auto", "none", "sqrt_d")
# What the backward pass recomputes per block instead of storing: nothing; everything but the
# outputs of its matmuls (scores, softmax, norms, activations); everything but the block's input.
REMAT_POLICIES = {
  "none": None,
  "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "full": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  kind: str = "decoder"  # encoder (MLM) | decoder (causal LM)
  # The bytes tokenizer's (data.tokenizer="bytes"); training sets the tokenizer's.
  vocab_size: int = 261
  num_layers: int = 6
  emb_dim: int = 512
  num_heads: int = 8
  num_kv_heads: int = 0  # 0 = num_heads (MHA); 1 = MQA; else GQA
  head_dim: int = 0  # 0 = emb_dim // num_heads
  mlp_dim: int = 2048
  dropout_rate: float = 0.0
  attention_dropout_rate: float = -1.0  # on attention probabilities; -1 = dropout_rate
  activation: str = "gelu"  # gelu | swiglu
  norm: str = "layernorm"  # layernorm | rmsnorm
  norm_eps: float = 1e-6
  # Encoder only: False = post-LN (BERT/RoFormer); decoders are always pre-LN.
  pre_norm: bool = False
  use_bias: bool = True
  # Biases on the query, key and value projections only (Qwen2); use_bias=True already has them.
  qkv_bias: bool = False
  # Pre-LN blocks computing x + attn(norm1(x)) + mlp(norm2(x)) (GPT-J, GPT-NeoX / Pythia): the MLP
  # reads the block's input, not the attention's output.
  parallel_residual: bool = False
  tie_embeddings: bool = True
  embedding_size: int = 0  # 0 = emb_dim; else embeddings are projected up (HF `embeddings_project`)
  type_vocab_size: int = 0  # 0 = no token-type embeddings (HF RoFormer has 2)
  dtype: str = "float32"  # compute dtype: float32 | bfloat16
  param_dtype: str = "float32"
  attention_impl: str = "auto"  # dense | chunked | auto | cpu_flash | splash | flash_bias | cudnn
  # Query/key block of the chunked kernel, and the sequence block of position-wise layers.
  attention_block: int = 512
  attention_window: int = 0  # sliding window: keys within this many positions of the query; 0 = all
  # "sliding" (|qpos - kpos| < window), "blockwise" (xPos's BCA: the query's block of
  # window / 2 positions and the block before it) or "chunked" (Llama 4: the query's chunk of
  # window positions only).
  attention_window_kind: str = "sliding"
  # Token-embedding scale: "auto" (the encoding's paper), "none" (BERT: N(0, 0.02^2), unscaled) or
  # "sqrt_d" (Vaswani / fairseq: N(0, 1/E), multiplied by sqrt(E)).
  embed_scale: str = "auto"
  scan_layers: bool = False  # one block with stacked [num_layers, ...] parameters, run by lax.scan
  remat: str = "none"  # none | block | full (see REMAT_POLICIES)
  attention_window_pattern: str = ""  # per-layer windows "w1,w2,..." repeated over layers
  global_tokens: int = 0  # encoder: positions < N attend to and are attended by all tokens
  attention: str = "softmax"  # softmax | linear | mla
  linear_feature_map: str = "elu"  # linear attention: elu | favor
  kv_lora_rank: int = 0  # mla: latent width of keys and values
  q_lora_rank: int = 0  # mla: latent width of queries (0 = no query compression)
  qk_rope_head_dim: int = 0  # mla: width of the rotary key shared by all heads
  qk_norm: str = "none"  # none | rmsnorm (per head) | rmsnorm_whole (OLMo 2) | l2 (Llama 4)
  qk_norm_kinds: str = ""  # kinds of posenc.layer_pattern whose layers normalise; "" = all
  attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss)
  forget_gate: bool = False  # FoX: a per-head forget gate decaying the logits (decoders)
  posenc: PosEncConfig = PosEncConfig()

  def __post_init__(self):
    # Validated once, when built: the library trusts a ModelConfig that exists.
    validate_model(self)

  @property
  def layers(self) -> tuple[LayerSpec, ...]:
    """Every layer's LayerSpec (encoding, window, QK-norm), resolved once per config from the
    patterns (cached by the config's value: the instance's fields stay the whole state)."""
    return _layers_of(self)


@functools.lru_cache(maxsize=256)
def _layers_of(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
  return layer_specs(cfg)


def resolve_head_dim(cfg: ModelConfig) -> int:
  return cfg.head_dim or cfg.emb_dim // cfg.num_heads


def resolve_num_kv_heads(cfg: ModelConfig) -> int:
  return cfg.num_kv_heads or cfg.num_heads


def resolve_embed_scale(cfg: ModelConfig) -> str:
  """ "none" or "sqrt_d": `model.embed_scale`, with "auto" resolved by the encoding's paper."""
  if cfg.embed_scale == "auto":
    return POSENCS[cfg.posenc.kind].paper_embed_scale
  return cfg.embed_scale


def _check_choice(field, value, allowed):
  if value not in allowed:
    raise ValueError(f"{field}={value!r} is not one of {list(allowed)}")


def validate_model(cfg: ModelConfig) -> None:
  """Raises ValueError naming the field and its allowed values for every bad setting.

  Runs when a ModelConfig is built; its posenc is validated too (causal for decoders). Whether
  the model can run at a given length is `unsupported_length`.
  """
  _check_choice("model.kind", cfg.kind, MODEL_KINDS)
  _check_choice("model.activation", cfg.activation, ACTIVATIONS)
  _check_choice("model.norm", cfg.norm, NORMS)
  _check_choice("model.dtype", cfg.dtype, DTYPES)
  _check_choice("model.param_dtype", cfg.param_dtype, DTYPES)
  _check_choice("model.attention_impl", cfg.attention_impl, KERNELS)
  _check_choice("model.embed_scale", cfg.embed_scale, EMBED_SCALES)
  _check_choice("model.attention_window_kind", cfg.attention_window_kind, WINDOW_KINDS)
  _check_choice("model.remat", cfg.remat, REMAT_POLICIES)
  _check_choice("model.attention", cfg.attention, ATTENTIONS)
  for name in ("vocab_size", "num_layers", "emb_dim", "num_heads", "mlp_dim", "attention_block"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"model.{name}={getattr(cfg, name)} must be a positive integer")
  for name in (
    "num_kv_heads", "head_dim", "embedding_size", "type_vocab_size", "attention_window",
    "global_tokens", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
  ):  # fmt: skip
    if getattr(cfg, name) < 0:
      raise ValueError(f"model.{name}={getattr(cfg, name)} must be >= 0 (0 = default)")
  if not 0.0 <= cfg.dropout_rate < 1.0:
    raise ValueError(f"model.dropout_rate={cfg.dropout_rate} must be in [0, 1)")
  if not (0.0 <= cfg.attention_dropout_rate < 1.0 or cfg.attention_dropout_rate == -1.0):
    raise ValueError(
      f"model.attention_dropout_rate={cfg.attention_dropout_rate} must be in [0, 1) or -1 "
      "(= model.dropout_rate)"
    )
  if not cfg.norm_eps > 0.0:
    raise ValueError(f"model.norm_eps={cfg.norm_eps} must be > 0")
  num_kv_heads = resolve_num_kv_heads(cfg)
  if cfg.num_heads % num_kv_heads:
    raise ValueError(
      f"model.num_heads={cfg.num_heads} is not divisible by model.num_kv_heads={num_kv_heads}"
    )
  if cfg.head_dim == 0 and cfg.emb_dim % cfg.num_heads:
    raise ValueError(
      f"model.emb_dim={cfg.emb_dim} is not divisible by model.num_heads={cfg.num_heads}; "
      "set model.head_dim explicitly"
    )
  if cfg.kind == "decoder" and cfg.embedding_size not in (0, cfg.emb_dim):
    raise ValueError(
      f"model.embedding_size={cfg.embedding_size} is only supported for model.kind='encoder'; "
      "use 0 for decoders"
    )
  if cfg.kind == "decoder" and cfg.type_vocab_size:
    raise ValueError(
      f"model.type_vocab_size={cfg.type_vocab_size} is only supported for model.kind='encoder'; "
      "use 0 for decoders"
    )
  if cfg.qkv_bias and cfg.use_bias:
    raise ValueError(
      "model.qkv_bias=True adds biases to the query, key and value projections only; "
      "model.use_bias=True already gives every dense layer one: set one of them False"
    )
  if cfg.parallel_residual and cfg.kind == "encoder" and not cfg.pre_norm:
    raise ValueError(
      "model.parallel_residual=True needs pre-LN blocks (each branch normalises the block's "
      "input); an encoder needs model.pre_norm=True for it"
    )
  _check_choice("model.qk_norm", cfg.qk_norm, QK_NORMS)
  _check_windows(cfg)
  _check_per_layer(cfg)
  if cfg.posenc.extension.kind != "none" and cfg.attention != "softmax":
    raise ValueError(
      f"posenc.extension.kind={cfg.posenc.extension.kind!r} remaps positions inside the softmax "
      f"attention kernels; model.attention={cfg.attention!r} does not honour it"
    )
  _check_forget_gate(cfg)
  attention = ATTENTIONS[cfg.attention]
  if cfg.posenc.kind in POSENCS and not (
    has_pattern(cfg.posenc) and parse_error(cfg.posenc, POSENCS)
  ):
    for layer in dict.fromkeys(layer_configs(cfg.posenc)):
      attention.check_config(_layer_view(cfg, layer), POSENCS[layer.kind])
  else:
    attention.check_config(cfg, POSENCS.get(cfg.posenc.kind))
  validate_posenc(
    cfg.posenc,
    causal=cfg.kind == "decoder",
    head_dim=attention.rotary_head_dim(cfg, resolve_head_dim(cfg)),
  )


def unsupported_length(cfg: ModelConfig, length: int) -> str | None:
  """Why the model of `cfg` cannot run sequences of `length` positions, or None."""
  for layer in dict.fromkeys(spec.posenc for spec in cfg.layers):
    if reason := POSENCS[layer.kind].unsupported_length(layer, length):
      return reason
  return None


def _layer_view(cfg: ModelConfig, layer_posenc: PosEncConfig) -> ModelConfig:
  """`cfg` with one layer's encoding config, so that a refusal names that layer's kind. Not
  re-validated: it is a view of the config being validated, used only for its checks."""
  view = copy.copy(cfg)
  object.__setattr__(view, "posenc", layer_posenc)
  return view


def _check_per_layer(cfg: ModelConfig) -> None:
  """Per-layer encodings, QK-norm and query temperature against the rest of the model."""
  kinds = pattern_kinds(cfg.posenc)
  stray = [k for k in kind_list(cfg.qk_norm_kinds) if k not in kinds]
  if cfg.qk_norm_kinds and (stray or cfg.qk_norm == "none"):
    raise ValueError(
      f"model.qk_norm_kinds={cfg.qk_norm_kinds!r} must name kinds of the model's layers "
      f"{sorted(set(kinds))} and needs a model.qk_norm other than 'none'"
    )
  if cfg.scan_layers and has_pattern(cfg.posenc):
    raise ValueError(
      "posenc.layer_pattern / posenc.max_wavelength_pattern give layers different encodings, "
      "which model.scan_layers=True (one stacked block) cannot; set one of them off"
    )
  for field, value, off in (
    ("model.qk_norm", cfg.qk_norm, "none"),
    ("posenc.query_scale", cfg.posenc.query_scale, "none"),
    ("model.attention_sinks", cfg.attention_sinks, False),
    ("model.forget_gate", cfg.forget_gate, False),
  ):
    if value != off and cfg.attention != "softmax":
      raise ValueError(
        f"{field}={value!r} is implemented by softmax attention only, not "
        f"model.attention={cfg.attention!r}; set it to {off!r} or model.attention='softmax'"
      )


def _check_forget_gate(cfg: ModelConfig) -> None:
  if cfg.forget_gate and cfg.kind != "decoder":
    raise ValueError(
      "model.forget_gate=True decays the logits by the gates between a key and a later query "
      "(FoX), which needs a causal decoder (model.kind='decoder')"
    )
  if cfg.forget_gate and cfg.attention_sinks:
    raise ValueError(
      "model.forget_gate=True and model.attention_sinks=True cannot be combined: the kernels "
      "drop the forget gate's per-query term, which a sink logit would no longer cancel; set "
      "one of them False"
    )
  if cfg.forget_gate and cfg.posenc.extension.kind != "none":
    raise ValueError(
      f"model.forget_gate=True and posenc.extension.kind={cfg.posenc.extension.kind!r} cannot "
      "be combined: the forget gate's running sums follow the tokens, not the remapped positions"
    )


def _check_windows(cfg: ModelConfig) -> None:
  try:
    windows = int_list(cfg.attention_window_pattern) or (cfg.attention_window,)
  except ValueError:
    raise ValueError(
      f"model.attention_window_pattern={cfg.attention_window_pattern!r} must be "
      "comma-separated window sizes >= 0 (0 = global), e.g. '4096,0'"
    ) from None
  if cfg.scan_layers and cfg.attention_window_pattern:
    raise ValueError(
      f"model.attention_window_pattern={cfg.attention_window_pattern!r} gives layers different "
      "windows, which model.scan_layers=True (one stacked block) cannot; set one of them off"
    )
  if cfg.attention_window_kind != "sliding" and cfg.global_tokens:
    raise ValueError(
      "model.global_tokens applies to sliding windows, not "
      f"model.attention_window_kind={cfg.attention_window_kind!r}"
    )
  if cfg.global_tokens and cfg.kind != "encoder":
    raise ValueError(
      f"model.global_tokens={cfg.global_tokens} is for encoders (model.kind='encoder'); "
      "use 0 for decoders"
    )
  if cfg.global_tokens and not any(windows):
    raise ValueError(
      f"model.global_tokens={cfg.global_tokens} needs a sliding window "
      "(model.attention_window or model.attention_window_pattern): without one every token "
      "is already global"
    )
