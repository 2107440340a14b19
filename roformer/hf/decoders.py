"""Import of Hugging Face causal LMs (Llama, Mistral, Qwen2, GPT-NeoX / Pythia) as this library's
`Decoder`, no torch.

`load_hf_decoder(dir)` returns a Decoder: `model(input_ids_BL, positions_BL)` gives the HF model's
logits in eval mode, and the model evaluates, fine-tunes and generates (`roformer.generate`) like
one trained here, with every encoding hook and kernel. Each config.json field that changes the
numbers maps onto a `model.*` or `posenc.*` field; one this library cannot reproduce is refused
with one line naming it.

What the families share and where they differ:
- RoPE in the half layout (pairs (i, i + d/2), HF's `rotate_half`) on the first
  int(head_dim * partial_rotary_factor) dims of each head (all of them outside GPT-NeoX), with
  HF's `rope_type` scalings linear, dynamic, yarn, llama3 and longrope
  (roformer.posenc.rope_scaling).
- Llama, Mistral, Qwen2: RMSNorm (weight times the normalised float32 input), SwiGLU MLP
  (silu(gate) * up), pre-LN. Biases: Llama's attention_bias / mlp_bias, none in Mistral, q/k/v
  only in Qwen2. Sliding windows: Mistral's on every layer, Qwen2's on the layers its
  layer_types name.
- GPT-NeoX: LayerNorm, exact-GELU MLP, biases everywhere, q/k/v fused per head, and (Pythia)
  a parallel residual.
"""

from collections.abc import Mapping

import numpy as np

from roformer.hf.checkpoint import (
  HFConversionError,
  abstract_params,
  fill_model,
  load_hf_tensors,
  map_params,
  model_config,
  read_hf_config,
)
from roformer.nn.config import ModelConfig
from roformer.nn.model import Decoder
from roformer.posenc.config import PosEncConfig, RopeScaling
from roformer.posenc.rope import rotary_dims

# The HF config defaults of the fields read, per model_type (for keys a config.json leaves out).
_SHARED = {"tie_word_embeddings": False, "max_position_embeddings": 2048}
_LLAMA = {**_SHARED, "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
          "mlp_bias": False}  # fmt: skip
_DEFAULTS = {
  "llama": _LLAMA,
  "mistral": {**_LLAMA, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
  "qwen2": {
    **_LLAMA,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
  },
  "gpt_neox": {
    **_SHARED,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "use_parallel_residual": True,
    "attention_bias": True,
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000.0,
  },
}
# The config.json model_type values load_hf_decoder reads.
DECODER_MODEL_TYPES = tuple(_DEFAULTS)
# HF's num_key_value_heads when the key is absent: Mistral 8, Qwen2 32; null (or absent
# elsewhere) means the number of heads.
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32}
_REQUIRED = (
  "vocab_size",
  "hidden_size",
  "num_hidden_layers",
  "num_attention_heads",
  "intermediate_size",
)
# The gated MLP's activation: silu(gate) * up is model.activation="swiglu".
_GATED_ACTIVATIONS = {"silu": "swiglu"}
# GPT-NeoX's MLP activation: only the exact (erf) GELU is the model's "gelu".
_NEOX_ACTIVATIONS = {"gelu": "gelu"}
_ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Buffers of older exports that HF itself skips when loading (recomputed, not learnt).
_IGNORED_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def _field(c: Mapping, key: str, defaults: Mapping):
  """c[key], with HF's default when the key is absent or null."""
  value = c.get(key)
  return defaults.get(key) if value is None else value


# ---- Config ----


def hf_decoder_config(hf_config: Mapping, **overrides) -> ModelConfig:
  """The ModelConfig of the Decoder that reproduces an HF Llama/Mistral/Qwen2/GPT-NeoX causal LM.

  Args:
    hf_config: the parsed config.json.
    **overrides: ModelConfig fields that change no parameter (`checkpoint.OVERRIDABLE_FIELDS`),
      e.g. `dtype="bfloat16"` or `attention_impl="chunked"`.

  Raises:
    HFConversionError: one line naming the config.json field this library cannot reproduce.
  """
  model_type = hf_config.get("model_type")
  if model_type not in _DEFAULTS:
    raise HFConversionError(
      f"config.json model_type={model_type!r} is not supported; load_hf_decoder reads "
      f"{sorted(_DEFAULTS)} (load_hf_roformer reads 'roformer')"
    )
  missing = [key for key in _REQUIRED if key not in hf_config]
  if missing:
    raise HFConversionError(f"config.json lacks the required keys {missing}")
  c, defaults = hf_config, _DEFAULTS[model_type]
  hidden, heads = c["hidden_size"], c["num_attention_heads"]
  if model_type == "gpt_neox":
    if hidden % heads:
      raise HFConversionError(
        f"config.json hidden_size={hidden} is not divisible by num_attention_heads={heads}"
      )
    head_dim, kv_heads, family = hidden // heads, heads, _neox_fields(c, defaults)
  else:
    head_dim = c.get("head_dim") or hidden // heads
    kv_heads = c.get("num_key_value_heads", _DEFAULT_KV_HEADS.get(model_type)) or heads
    family = _llama_fields(c, defaults, model_type)
  fields = dict(
    kind="decoder",
    vocab_size=c["vocab_size"],
    num_layers=c["num_hidden_layers"],
    emb_dim=hidden,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    mlp_dim=c["intermediate_size"],
    # Eval mode has no dropout; fine-tuning sets its own rate.
    dropout_rate=0.0,
    tie_embeddings=bool(_field(c, "tie_word_embeddings", defaults)),
    # HF reads the embedding table as is (no sqrt(d) multiplier).
    embed_scale="none",
    posenc=_rope(c, defaults, model_type, head_dim),
    **family,
  )
  return model_config(fields, overrides)


def _llama_fields(c: Mapping, defaults: Mapping, model_type: str) -> dict:
  act = _field(c, "hidden_act", defaults)
  if act not in _GATED_ACTIVATIONS:
    raise HFConversionError(
      f"config.json hidden_act={act!r} is not supported; allowed: {sorted(_GATED_ACTIVATIONS)} "
      "(the gated MLP silu(gate) * up is model.activation='swiglu')"
    )
  if model_type == "llama":
    attention_bias = bool(_field(c, "attention_bias", defaults))
    mlp_bias = bool(_field(c, "mlp_bias", defaults))
    if attention_bias != mlp_bias:
      field = "attention_bias" if attention_bias else "mlp_bias"
      raise HFConversionError(
        f"config.json {field}=True with {'mlp_bias' if attention_bias else 'attention_bias'}="
        "False is not supported: the model biases every dense layer (model.use_bias) or the "
        "query/key/value projections alone (model.qkv_bias)"
      )
    use_bias, qkv_bias = attention_bias, False
  else:  # Mistral has no biases; Qwen2 biases q, k and v only.
    use_bias, qkv_bias = False, model_type == "qwen2"
  return dict(
    activation=_GATED_ACTIVATIONS[act],
    norm="rmsnorm",
    norm_eps=float(_field(c, "rms_norm_eps", defaults)),
    use_bias=use_bias,
    qkv_bias=qkv_bias,
    **_windows(c, defaults, model_type),
  )


def _neox_fields(c: Mapping, defaults: Mapping) -> dict:
  act = _field(c, "hidden_act", defaults)
  if act not in _NEOX_ACTIVATIONS:
    raise HFConversionError(
      f"config.json hidden_act={act!r} is not supported; allowed: {sorted(_NEOX_ACTIVATIONS)} "
      "(the exact erf GELU; 'gelu_new' and 'gelu_fast' are tanh approximations)"
    )
  if not _field(c, "attention_bias", defaults):
    raise HFConversionError(
      "config.json attention_bias=False is not supported for gpt_neox: its MLP keeps biases, "
      "and the model biases every dense layer or none (model.use_bias)"
    )
  return dict(
    activation="gelu",
    norm="layernorm",
    norm_eps=float(_field(c, "layer_norm_eps", defaults)),
    use_bias=True,
    parallel_residual=bool(_field(c, "use_parallel_residual", defaults)),
  )


def _windows(c: Mapping, defaults: Mapping, model_type: str) -> dict:
  """model.attention_window(_pattern) from Mistral's sliding_window or Qwen2's layer_types.

  HF masks keys with kv_idx > q_idx - sliding_window (masking_utils.sliding_window_overlay),
  i.e. q - k < sliding_window: the model's window of the same size (q - k < window).
  """
  if model_type == "llama":  # LlamaForCausalLM attends to every earlier key
    return {}
  window = int(_field(c, "sliding_window", defaults) or 0)
  if model_type == "mistral":  # every layer (MistralForCausalLM ignores layer_types)
    return dict(attention_window=window)
  if not _field(c, "use_sliding_window", defaults):
    window = 0
  n = c["num_hidden_layers"]
  types = c.get("layer_types") or [
    "sliding_attention"
    if window and i >= _field(c, "max_window_layers", defaults)
    else "full_attention"
    for i in range(n)
  ]
  unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
  if unknown or len(types) != n:
    raise HFConversionError(
      f"config.json layer_types={types} must list 'sliding_attention' or 'full_attention' for "
      f"each of the {n} layers"
    )
  per_layer = [window if t == "sliding_attention" else 0 for t in types]
  if len(set(per_layer)) == 1:
    return dict(attention_window=per_layer[0])
  return dict(attention_window_pattern=",".join(map(str, per_layer)))


def _rope(c: Mapping, defaults: Mapping, model_type: str, head_dim: int) -> PosEncConfig:
  """posenc: half-layout RoPE with HF's base, rotated fraction and scaling.

  Reads transformers 5's `rope_parameters` or the older `rope_theta` / `rope_scaling` /
  `partial_rotary_factor` (GPT-NeoX: `rotary_emb_base` / `rotary_pct`).
  """
  where = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
  params = dict(c.get(where) or {})
  if any(isinstance(v, Mapping) for v in params.values()):
    raise HFConversionError(
      f"config.json {where} differs per layer type ({sorted(params)}); one RoPE for every layer "
      "is supported"
    )
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in _ROPE_KINDS:
    raise HFConversionError(
      f"config.json {where}.rope_type={kind!r} is not supported; allowed: {list(_ROPE_KINDS)}"
    )
  theta_key, fraction_key = "rope_theta", "partial_rotary_factor"
  if model_type == "gpt_neox":
    theta_key, fraction_key = "rotary_emb_base", "rotary_pct"
  theta = params.get("rope_theta", c.get("rope_theta", _field(c, theta_key, defaults) or 10000.0))
  fraction = params.get(
    "partial_rotary_factor", c.get("partial_rotary_factor", _field(c, fraction_key, defaults))
  )
  fraction = 1.0 if fraction is None else float(fraction)
  if model_type != "gpt_neox" and fraction != 1.0:
    raise HFConversionError(
      f"config.json partial_rotary_factor={fraction} is not supported for {model_type}: "
      "HF's Llama-family attention rotates every dim of a head"
    )
  dims = int(head_dim * fraction)  # HF's rotary_ndims
  if dims < 2 or dims % 2 or rotary_dims(head_dim, fraction) != dims:
    raise HFConversionError(
      f"config.json partial_rotary_factor={fraction} rotates {dims} of {head_dim} dims; an even "
      "number >= 2 is supported"
    )
  return PosEncConfig(
    kind="rope",
    rope_layout="half",
    max_wavelength=float(theta),
    rope_fraction=fraction,
    scaling=_scaling(c, params, kind, where),
  )


def _scaling(c: Mapping, params: Mapping, kind: str, where: str) -> RopeScaling:
  """posenc.scaling for HF's rope_type (modeling_rope_utils' definitions)."""
  if kind == "default":
    return RopeScaling()
  max_len = int(c.get("max_position_embeddings") or 0)
  # HF prefers a top-level original_max_position_embeddings (Phi-3 style), then the rope dict's,
  # then max_position_embeddings.
  original = int(
    c.get("original_max_position_embeddings")
    or params.get("original_max_position_embeddings")
    or max_len
  )
  factor = params.get("factor")
  if factor is None and kind in ("yarn", "longrope") and original:
    factor = max_len / original
  if factor is None:
    raise HFConversionError(f"config.json {where}.factor is required for rope_type={kind!r}")
  if kind == "linear":
    return RopeScaling(kind="linear", factor=float(factor))
  if kind == "dynamic":
    # HF's dynamic NTK measures the length against max_position_embeddings.
    return RopeScaling(kind="dynamic", factor=float(factor), original_max_len=max_len)
  if kind == "longrope":
    for name in ("short_factor", "long_factor"):
      if not isinstance(params.get(name), list | tuple):
        raise HFConversionError(
          f"config.json {where}.{name} is required for rope_type='longrope' (a list of "
          "head_dim / 2 numbers)"
        )
    return RopeScaling(
      kind="longrope",
      factor=float(factor),
      original_max_len=original,
      short_factor=tuple(params["short_factor"]),
      long_factor=tuple(params["long_factor"]),
      attention_factor=float(params.get("attention_factor") or 0.0),
    )
  if kind == "llama3":
    return RopeScaling(
      kind="llama3",
      factor=float(factor),
      original_max_len=original,
      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
    )
  if params.get("attention_factor") is not None:
    raise HFConversionError(
      f"config.json {where}.attention_factor={params['attention_factor']} is not supported; "
      "YaRN's factor is derived from factor, mscale and mscale_all_dim"
    )
  if params.get("truncate", True) is False:
    raise HFConversionError(
      f"config.json {where}.truncate=False is not supported; YaRN's correction range is "
      "rounded to whole dims (truncate=True)"
    )
  return RopeScaling(
    kind="yarn",
    factor=float(factor),
    original_max_len=original,
    beta_fast=float(params.get("beta_fast") or 32.0),
    beta_slow=float(params.get("beta_slow") or 1.0),
    mscale=float(params.get("mscale") or 0.0),
    mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
  )


# ---- Tensors ----


def _llama_sources(cfg: ModelConfig) -> dict[tuple, tuple[str, str]]:
  """Our parameter path -> (HF tensor name, rule) for Llama, Mistral and Qwen2."""
  src = {
    ("embed", "embedding"): ("model.embed_tokens.weight", "copy"),
    ("final_norm", "scale"): ("model.norm.weight", "copy"),
    ("lm_head", "kernel"): ("lm_head.weight", "linear"),
  }
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", ("layers", i)
    src[(*ours, "attn_norm", "scale")] = (f"{hf}input_layernorm.weight", "copy")
    src[(*ours, "mlp_norm", "scale")] = (f"{hf}post_attention_layernorm.weight", "copy")
    for proj, name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      src[(*ours, "attn", proj, "kernel")] = (f"{hf}self_attn.{name}.weight", "heads_in")
      src[(*ours, "attn", proj, "bias")] = (f"{hf}self_attn.{name}.bias", "heads_bias")
    src[(*ours, "attn", "out", "kernel")] = (f"{hf}self_attn.o_proj.weight", "heads_out")
    src[(*ours, "attn", "out", "bias")] = (f"{hf}self_attn.o_proj.bias", "copy")
    for ours_name, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
      src[(*ours, "mlp", ours_name, "kernel")] = (f"{hf}mlp.{name}.weight", "linear")
      src[(*ours, "mlp", ours_name, "bias")] = (f"{hf}mlp.{name}.bias", "copy")
  return src


def _neox_sources(cfg: ModelConfig, tensors: Mapping) -> dict[tuple, tuple[str, str]]:
  """Our parameter path -> (HF tensor name, rule) for GPT-NeoX (q/k/v as `_split_neox_qkv`)."""
  # transformers 5 writes the output layer as embed_out (older name) and reads both.
  head = "lm_head.weight" if "lm_head.weight" in tensors else "embed_out.weight"
  src = {
    ("embed", "embedding"): ("gpt_neox.embed_in.weight", "copy"),
    ("final_norm", "scale"): ("gpt_neox.final_layer_norm.weight", "copy"),
    ("final_norm", "bias"): ("gpt_neox.final_layer_norm.bias", "copy"),
    ("lm_head", "kernel"): (head, "linear"),
  }
  for i in range(cfg.num_layers):
    hf, ours = f"gpt_neox.layers.{i}.", ("layers", i)
    for norm, name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
      src[(*ours, norm, "scale")] = (f"{hf}{name}.weight", "copy")
      src[(*ours, norm, "bias")] = (f"{hf}{name}.bias", "copy")
    for proj in ("query", "key", "value"):
      src[(*ours, "attn", proj, "kernel")] = (f"{hf}attention.{proj}.weight", "heads_in")
      src[(*ours, "attn", proj, "bias")] = (f"{hf}attention.{proj}.bias", "heads_bias")
    src[(*ours, "attn", "out", "kernel")] = (f"{hf}attention.dense.weight", "heads_out")
    src[(*ours, "attn", "out", "bias")] = (f"{hf}attention.dense.bias", "copy")
    for ours_name, name in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
      src[(*ours, "mlp", ours_name, "kernel")] = (f"{hf}mlp.{name}.weight", "linear")
      src[(*ours, "mlp", ours_name, "bias")] = (f"{hf}mlp.{name}.bias", "copy")
  return src


def _split_neox_qkv(tensors: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The tensors with each fused `attention.query_key_value` split into query, key and value.

  Its output features run head by head, q, k and v of head 0 first: [H, 3, K] (HF views them as
  [..., H, 3K] and chunks the last axis in three).
  """
  H, K = cfg.num_heads, cfg.head_dim
  out = dict(tensors)
  for i in range(cfg.num_layers):
    fused = f"gpt_neox.layers.{i}.attention.query_key_value"
    for suffix in ("weight", "bias"):
      name = f"{fused}.{suffix}"
      if name not in out:
        continue
      array = out.pop(name)
      if array.shape[0] != 3 * H * K:
        raise HFConversionError(
          f"{name} has shape {array.shape}; the config needs {3 * H * K} output features "
          f"(3 x {H} heads x {K})"
        )
      parts = array.reshape(H, 3, K, *array.shape[1:])
      for j, proj in enumerate(("query", "key", "value")):
        out[f"gpt_neox.layers.{i}.attention.{proj}.{suffix}"] = parts[:, j].reshape(
          H * K, *array.shape[1:]
        )
  return out


def hf_decoder_params(
  tensors: Mapping[str, np.ndarray], cfg: ModelConfig, param_shapes: Mapping[tuple, tuple], *,
  model_type: str,
) -> dict[tuple, np.ndarray]:  # fmt: skip
  """Every HF tensor mapped onto our parameters; raises naming any missing or unused tensor."""
  tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
  if model_type == "gpt_neox":
    tensors = _split_neox_qkv(tensors, cfg)
    sources = _neox_sources(cfg, tensors)
  else:
    sources = _llama_sources(cfg)
  mapped = map_params(tensors, sources, param_shapes)
  if cfg.tie_embeddings:
    embed = sources[("embed", "embedding")][0]
    # A tied output layer may still be stored; it must be the embedding table.
    mapped.check_derived(
      tensors,
      {
        name: (lambda: tensors.get(embed), f"{embed} (tie_word_embeddings=True)")
        for name in ("lm_head.weight", "embed_out.weight")
      },
    )
  mapped.raise_if_bad(tensors, "Decoder")
  return mapped.params


# ---- Model ----


def load_hf_decoder(path, **overrides) -> Decoder:
  """Loads an HF causal LM directory (config.json + safetensors) as a Decoder, without torch.

  Args:
    path: a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or GPTNeoXForCausalLM
      directory written by `save_pretrained`.
    **overrides: parameter-free ModelConfig fields (`checkpoint.OVERRIDABLE_FIELDS`).

  Returns:
    The Decoder: `model(input_ids [B, L], positions [B, L]) -> float32 logits [B, L, V]`, equal
    to the HF model's logits in eval mode at positions 0 .. L - 1; `model.cfg` is its config.

  Raises:
    HFConversionError: for a config field this library cannot reproduce, or a missing,
      mis-shaped, non-finite or unused tensor, naming it.
  """
  hf_config = read_hf_config(path)
  cfg = hf_decoder_config(hf_config, **overrides)
  tensors = load_hf_tensors(path)
  graphdef, flat, param_shapes = abstract_params(cfg)
  params = hf_decoder_params(tensors, cfg, param_shapes, model_type=hf_config["model_type"])
  return fill_model(graphdef, flat, params, cfg)
