"""The model's configuration: ModelConfig, its validation, and what follows from its fields.

Validated once, when a ModelConfig is built; the model and the library trust one that exists.
"""

import copy
import dataclasses
import functools

import jax

from roformer.fields import param
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
  kind: str = param(
    "decoder", '"decoder" (causal LM, next-token loss) or "encoder" (BERT-style masked LM).'
  )
  vocab_size: int = param(
    261,
    'Vocabulary size: the bytes tokenizer\'s (data.tokenizer="bytes") until training sets the '
    "tokenizer's; not a field of the config files.",
  )
  num_layers: int = param(6, "Number of Transformer blocks.")
  emb_dim: int = param(512, "Width of the residual stream (D).")
  num_heads: int = param(8, "Number of query heads (H).")
  num_kv_heads: int = param(
    0,
    "Number of key/value heads (G): 0 = num_heads (MHA), 1 = MQA, otherwise GQA (divides "
    "num_heads).",
  )
  head_dim: int = param(0, "Per-head dimension (K): 0 = emb_dim // num_heads.")
  mlp_dim: int = param(2048, "Hidden width of the MLP (F).")
  dropout_rate: float = param(
    0.0, "Dropout on attention probabilities and residual branches during training (0 = off)."
  )
  attention_dropout_rate: float = param(
    -1.0,
    "Dropout on attention probabilities alone: -1 = model.dropout_rate. The fused kernels "
    "(attention_impl splash, flash_bias, cudnn) have none: 0 runs them with residual dropout "
    "kept.",
  )
  activation: str = param("gelu", 'MLP activation: "gelu" or "swiglu".')
  norm: str = param("layernorm", 'Normalisation layer: "layernorm" or "rmsnorm".')
  norm_eps: float = param(1e-6, "Epsilon of the normalisation layers.")
  pre_norm: bool = param(
    False,
    "Encoder only: True = pre-LN blocks, False = post-LN (BERT / RoFormer). Decoders are always "
    "pre-LN.",
  )
  use_bias: bool = param(True, "Whether dense layers have biases.")
  qkv_bias: bool = param(
    False,
    "Biases on the query, key and value projections only, with use_bias=False (Qwen2's layout; "
    "use_bias=True already has them).",
  )
  parallel_residual: bool = param(
    False,
    "Pre-LN blocks computing x + attn(norm1(x)) + mlp(norm2(x)): attention and MLP in parallel, "
    "both reading the block's input, not the attention's output (GPT-J, GPT-NeoX / Pythia). "
    "Encoders need pre_norm=True.",
  )
  tie_embeddings: bool = param(True, "Share the input embedding with the output projection.")
  embedding_size: int = param(
    0,
    "Width of the token embeddings: 0 = emb_dim; otherwise they are projected up to emb_dim "
    "(Hugging Face RoFormer's embeddings_project).",
  )
  type_vocab_size: int = param(
    0, "Number of token types (segment A/B embeddings): 0 = none (Hugging Face RoFormer has 2)."
  )
  dtype: str = param(
    "float32",
    'Compute dtype: "float32" or "bfloat16" (softmax, norms and RoPE angles stay float32).',
  )
  param_dtype: str = param("float32", "Parameter (and optimizer state) dtype.")
  attention_impl: str = param(
    "auto",
    'Attention kernel: "dense" (materialises scores), "chunked" (blockwise), "auto" (the '
    'fastest kernel the call fits on its platform, else dense or chunked), "cpu_flash", '
    '"splash", "flash_bias" or "cudnn" (roformer/nn/attention/kernels/).',
  )
  attention_block: int = param(
    512,
    "Query/key block of the chunked kernel, and the sequence block of position-wise layers and "
    "of blockwise evaluation.",
  )
  attention_window: int = param(
    0, "Sliding-window attention: keys within this many positions of the query (0 = all keys)."
  )
  attention_window_kind: str = param(
    "sliding",
    'How attention_window limits keys: "sliding" (within attention_window positions of the '
    'query: |qpos - kpos| < window), "blockwise" (xPos\'s blockwise causal attention: the '
    'query\'s block of attention_window / 2 positions and the block before it) or "chunked" '
    "(Llama 4's chunked local attention: the query's own chunk of attention_window positions).",
  )
  embed_scale: str = param(
    "auto",
    'Token embeddings: "auto" = as the encoding\'s paper ("none" for learned and rope, "sqrt_d" '
    'for the others; see docs/fidelity.md), "none" = BERT\'s N(0, 0.02^2) unscaled (a learned '
    'position table likewise), "sqrt_d" = N(0, 1/d) multiplied by sqrt(d) (Vaswani et al., '
    "fairseq; a learned position table N(0, 1/d) unscaled). Comparisons set one value for every "
    "encoding.",
  )
  scan_layers: bool = param(
    False,
    "Stack the blocks' parameters ([num_layers, ...]) and run them with lax.scan: one block to "
    "compile instead of num_layers (deep models compile faster). Checkpoints of the two layouts "
    "differ, and Hugging Face imports need False.",
  )
  remat: str = param(
    "none",
    'Rematerialisation of each block in the backward pass: "none" (store every '
    'activation), "block" (store only matmul outputs; recompute scores, softmax, norms, '
    'activations) or "full" (store only the block\'s input).',
  )
  attention_window_pattern: str = param(
    "",
    'Per-layer windows "w1,w2,...", repeated over the layers (0 = global; "" = attention_window '
    'everywhere), e.g. "4096,0" alternates local and global layers as Gemma 2.',
  )
  global_tokens: int = param(
    0,
    "Encoders with a window: tokens at positions < N attend to and are attended by all "
    "(Longformer).",
  )
  attention: str = param(
    "softmax",
    'Attention kind: "softmax", "linear" (RoFormer eq. 19, RoPE in the numerator) or "mla" '
    "(DeepSeek-V2 multi-head latent attention with a decoupled RoPE key).",
  )
  linear_feature_map: str = param(
    "elu",
    'linear: feature map "elu" (elu + 1) or "favor" (Performer\'s positive random features).',
  )
  kv_lora_rank: int = param(
    0, "mla: width of the joint key/value latent (the decoding cache holds it per token)."
  )
  q_lora_rank: int = param(0, "mla: width of the query latent (0 = queries projected directly).")
  qk_rope_head_dim: int = param(
    0, "mla: width of the rotary key shared by all heads (and of each query's rotary part)."
  )
  qk_norm: str = param(
    "none",
    'QK-norm: "none"; "rmsnorm" (per head over the head dim, a learned scale, before RoPE, as '
    'Qwen3 and Gemma 3); "rmsnorm_whole" (over the whole query and key projections before the '
    'heads are split, a learned scale, before RoPE, as OLMo 2); "l2" (per head, no scale, after '
    "RoPE, as Llama 4). Softmax attention only.",
  )
  qk_norm_kinds: str = param(
    "",
    'Kinds of posenc.layer_pattern whose layers apply qk_norm ("" = every layer; Llama 4: "rope").',
  )
  attention_sinks: bool = param(
    False,
    "A learned sink logit per query head that joins the softmax denominator as a key with no "
    "value (gpt-oss), so a head can attend to nothing. Softmax attention only; every kernel and "
    "the cache.",
  )
  forget_gate: bool = param(
    False,
    "FoX (Forgetting Transformer): a forget gate per head from the layer input whose cumulative "
    "log-sigmoid sums bias the logits (c_i - c_j). Decoders, softmax attention; the paper runs "
    'it with posenc.kind="nope". Every kernel and the cache.',
  )
  posenc: PosEncConfig = param(
    PosEncConfig(), "The positional encoding: the posenc group of the config files."
  )

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
  if cfg.attention_impl not in KERNELS:
    raise ValueError(
      f"model.attention_impl={cfg.attention_impl!r} is not one of {list(KERNELS)}; a kernel of "
      "your own registers with roformer.nn.attention.kernels.register_kernel in a module that "
      "the config file imports (docs/extending.md#an-attention-kernel)"
    )
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
