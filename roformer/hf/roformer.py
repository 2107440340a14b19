"""Import of Hugging Face `RoFormerForMaskedLM` checkpoints (config.json + safetensors), no torch.

`load_hf_roformer(dir)` rebuilds the checkpoint as this library's `Encoder` with interleaved RoPE
and returns a callable that gives the same MLM logits as the HF model in eval mode.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.hf.checkpoint import (
  HFConversionError,
  abstract_params,
  check_overrides,
  fill_model,
  load_hf_tensors,
  map_params,
  read_hf_config,
)
from roformer.nn.config import ModelConfig
from roformer.posenc.config import PosEncConfig

# HF `hidden_act` -> model.activation. Only the exact (erf) GELU matches the Encoder, whose MLP and
# MLM head both use it; HF's "gelu_new"/"gelu_fast" are tanh approximations and "relu" is not GELU.
HF_ACTIVATIONS = {"gelu": "gelu"}

# RoFormerConfig defaults, for keys an older config.json leaves out.
_HF_DEFAULTS = {
  "hidden_act": "gelu",
  "layer_norm_eps": 1e-12,
  "type_vocab_size": 2,
  "max_position_embeddings": 1536,
  "hidden_dropout_prob": 0.1,
  "rotary_value": False,
  "is_decoder": False,
  "add_cross_attention": False,
  "tie_word_embeddings": True,
}
_HF_REQUIRED = (
  "vocab_size",
  "hidden_size",
  "num_hidden_layers",
  "num_attention_heads",
  "intermediate_size",
)
# HF RoFormer's sinusoidal table always uses base 10000 (it is not a config field).
_HF_ROPE_BASE = 10000.0


# ---- Config ----


def hf_config_to_model_config(hf_config: Mapping, **overrides) -> ModelConfig:
  """The ModelConfig of the Encoder that reproduces an HF RoFormerForMaskedLM.

  Args:
    hf_config: the parsed config.json of a RoFormer checkpoint.
    **overrides: ModelConfig fields that change no parameter (`checkpoint.OVERRIDABLE_FIELDS`), e.g.
      `dtype="bfloat16"` or a `posenc` with a RoPE scaling for evaluation at longer lengths.

  Returns:
    A ModelConfig with kind "encoder", post-LN, biases, tied embeddings (unless the checkpoint
    unties them) and interleaved RoPE with base 10000.

  Raises:
    HFConversionError: for configs the Encoder cannot reproduce, naming the HF key.
  """
  model_type = hf_config.get("model_type", "roformer")
  if model_type != "roformer":
    raise HFConversionError(f"config.json model_type={model_type!r}; only 'roformer' is supported")
  missing = [key for key in _HF_REQUIRED if key not in hf_config]
  if missing:
    raise HFConversionError(f"config.json lacks the required keys {missing}")
  c = {**_HF_DEFAULTS, **hf_config}
  if c["rotary_value"]:
    raise HFConversionError(
      "config.json rotary_value=True (RoPE also applied to the values) is not supported; "
      "the Encoder rotates queries and keys only (rotary_value=False)"
    )
  if c["is_decoder"] or c["add_cross_attention"]:
    raise HFConversionError(
      f"config.json is_decoder={c['is_decoder']}, add_cross_attention={c['add_cross_attention']}: "
      "only the bidirectional RoFormerForMaskedLM (both False) is supported"
    )
  if c["hidden_act"] not in HF_ACTIVATIONS:
    raise HFConversionError(
      f"config.json hidden_act={c['hidden_act']!r} is not supported; allowed: "
      f"{sorted(HF_ACTIVATIONS)} (the exact erf GELU the Encoder uses)"
    )
  if c["hidden_size"] % c["num_attention_heads"]:
    raise HFConversionError(
      f"config.json hidden_size={c['hidden_size']} is not divisible by "
      f"num_attention_heads={c['num_attention_heads']}"
    )
  check_overrides(overrides)
  hidden = c["hidden_size"]
  embedding_size = c.get("embedding_size") or hidden
  fields = dict(
    kind="encoder",
    vocab_size=c["vocab_size"],
    num_layers=c["num_hidden_layers"],
    emb_dim=hidden,
    num_heads=c["num_attention_heads"],
    num_kv_heads=0,
    head_dim=hidden // c["num_attention_heads"],
    mlp_dim=c["intermediate_size"],
    # One rate for every dropout site; HF's attention_probs_dropout_prob is the same in practice.
    dropout_rate=float(c["hidden_dropout_prob"]),
    activation=HF_ACTIVATIONS[c["hidden_act"]],
    norm="layernorm",
    norm_eps=float(c["layer_norm_eps"]),
    pre_norm=False,
    use_bias=True,
    tie_embeddings=bool(c["tie_word_embeddings"]),
    embedding_size=0 if embedding_size == hidden else embedding_size,
    type_vocab_size=c["type_vocab_size"],
    posenc=PosEncConfig(kind="rope", rope_layout="interleaved", max_wavelength=_HF_ROPE_BASE),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


# ---- Tensors ----


def _hf_sinusoidal_table(num_positions: int, head_dim: int) -> np.ndarray:
  """HF RoFormer's `embed_positions` table [P, K]: [sin(p theta_0..) | cos(p theta_0..)]."""
  theta_k = _HF_ROPE_BASE ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  angle_PK = np.arange(num_positions, dtype=np.float64)[:, None] * theta_k[None, :]
  return np.concatenate([np.sin(angle_PK), np.cos(angle_PK)], axis=1)


def _param_sources(cfg: ModelConfig) -> dict[tuple, tuple[str, str]]:
  """Our parameter path -> (HF tensor name, rule name)."""
  src = {
    ("embed", "embedding"): ("roformer.embeddings.word_embeddings.weight", "copy"),
    ("token_type_embed", "embedding"): ("roformer.embeddings.token_type_embeddings.weight", "copy"),
    ("embed_norm", "scale"): ("roformer.embeddings.LayerNorm.weight", "copy"),
    ("embed_norm", "bias"): ("roformer.embeddings.LayerNorm.bias", "copy"),
    ("embed_project", "kernel"): ("roformer.embeddings_project.weight", "linear"),
    ("embed_project", "bias"): ("roformer.embeddings_project.bias", "copy"),
    ("head_dense", "kernel"): ("cls.predictions.transform.dense.weight", "linear"),
    ("head_dense", "bias"): ("cls.predictions.transform.dense.bias", "copy"),
    ("head_norm", "scale"): ("cls.predictions.transform.LayerNorm.weight", "copy"),
    ("head_norm", "bias"): ("cls.predictions.transform.LayerNorm.bias", "copy"),
    ("head_bias",): ("cls.predictions.bias", "copy"),
    ("head_decoder", "kernel"): ("cls.predictions.decoder.weight", "linear"),
  }
  for i in range(cfg.num_layers):
    hf = f"roformer.encoder.layer.{i}."
    for proj in ("query", "key", "value"):
      src[("layers", i, "attn", proj, "kernel")] = (f"{hf}attention.self.{proj}.weight", "heads_in")
      src[("layers", i, "attn", proj, "bias")] = (f"{hf}attention.self.{proj}.bias", "heads_bias")
    src[("layers", i, "attn", "out", "kernel")] = (
      f"{hf}attention.output.dense.weight",
      "heads_out",
    )
    src[("layers", i, "attn", "out", "bias")] = (f"{hf}attention.output.dense.bias", "copy")
    src[("layers", i, "attn_norm", "scale")] = (f"{hf}attention.output.LayerNorm.weight", "copy")
    src[("layers", i, "attn_norm", "bias")] = (f"{hf}attention.output.LayerNorm.bias", "copy")
    src[("layers", i, "mlp", "up", "kernel")] = (f"{hf}intermediate.dense.weight", "linear")
    src[("layers", i, "mlp", "up", "bias")] = (f"{hf}intermediate.dense.bias", "copy")
    src[("layers", i, "mlp", "down", "kernel")] = (f"{hf}output.dense.weight", "linear")
    src[("layers", i, "mlp", "down", "bias")] = (f"{hf}output.dense.bias", "copy")
    src[("layers", i, "mlp_norm", "scale")] = (f"{hf}output.LayerNorm.weight", "copy")
    src[("layers", i, "mlp_norm", "bias")] = (f"{hf}output.LayerNorm.bias", "copy")
  return src


def hf_tensors_to_params(
  tensors: Mapping[str, np.ndarray],
  cfg: ModelConfig,
  param_shapes: Mapping[tuple, tuple],
  *,
  max_position_embeddings: int,
) -> dict[tuple, np.ndarray]:
  """Maps every HF tensor onto our parameters, checking that nothing is missing or left over.

  Args:
    tensors: HF name -> array (`load_hf_tensors`).
    cfg: the ModelConfig from `hf_config_to_model_config`.
    param_shapes: our parameter path (as in `nnx.to_flat_state`) -> shape.
    max_position_embeddings: the HF config's value (the size of its stored sinusoidal table).

  Returns:
    Our parameter path -> float32 array in our layout.

  Raises:
    HFConversionError: naming every missing, mis-shaped, non-finite or unused tensor.
  """
  sources = _param_sources(cfg)
  # The checkpoint stores the decoder tied to the word embeddings and its bias tied to
  # cls.predictions.bias; some exports keep only one name of a tied pair.
  if "cls.predictions.bias" not in tensors and "cls.predictions.decoder.bias" in tensors:
    sources[("head_bias",)] = ("cls.predictions.decoder.bias", "copy")
  mapped = map_params(tensors, sources, param_shapes)

  # Tensors that carry no parameter of ours but must agree with what the Encoder computes.
  checks = {
    "roformer.encoder.embed_positions.weight": (
      lambda: _hf_sinusoidal_table(max_position_embeddings, cfg.head_dim),
      "the RoFormer sinusoidal table (base 10000) that the Encoder's RoPE computes",
    ),
    "cls.predictions.decoder.bias": (
      lambda: tensors.get("cls.predictions.bias"),
      "cls.predictions.bias (HF ties them)",
    ),
  }
  if cfg.tie_embeddings:
    checks["cls.predictions.decoder.weight"] = (
      lambda: tensors.get("roformer.embeddings.word_embeddings.weight"),
      "roformer.embeddings.word_embeddings.weight (tie_word_embeddings=True)",
    )
  mapped.check_derived(tensors, checks)
  mapped.raise_if_bad(tensors, "Encoder")
  return mapped.params


# ---- Model ----


class HFRoFormer(nnx.Module):
  """An Encoder built from an HF checkpoint, called the way the HF model is.

  Attributes:
    model: the Encoder (call it with explicit positions, or train it: `train.init_from`).
    config: its ModelConfig.
    max_position_embeddings: the checkpoint's trained length limit (HF cannot run beyond it; the
      Encoder's RoPE can, which is what length-extrapolation studies measure).
  """

  def __init__(self, model: nnx.Module, config: ModelConfig, max_position_embeddings: int):
    self.model = model
    self.config = config
    self.max_position_embeddings = max_position_embeddings

  def __call__(self, input_ids_BL, token_type_ids=None):
    """MLM logits in eval mode (no dropout), positions 0 .. L-1 in every row as in HF.

    Args:
      input_ids_BL: int token ids [B, L].
      token_type_ids: int [B, L] in [0, type_vocab_size), or None for all 0.

    Returns:
      float32 logits [B, L, V].
    """
    input_ids_BL = jnp.asarray(input_ids_BL, dtype=jnp.int32)
    if input_ids_BL.ndim != 2:
      raise ValueError(f"input_ids must be [B, L], got shape {input_ids_BL.shape}")
    if token_type_ids is not None and jnp.shape(token_type_ids) != input_ids_BL.shape:
      raise ValueError(
        f"token_type_ids {jnp.shape(token_type_ids)} do not match input_ids {input_ids_BL.shape}"
      )
    # Explicit zeros (rather than None) keep one compiled function per input shape.
    if token_type_ids is None and self.config.type_vocab_size:
      token_type_ids = jnp.zeros_like(input_ids_BL)
    if token_type_ids is not None:
      token_type_ids = jnp.asarray(token_type_ids, dtype=jnp.int32)
    return _mlm_logits(self.model, input_ids_BL, token_type_ids)


@jax.jit
def _mlm_logits(model, input_ids_BL, token_type_ids_BL):
  B, L = input_ids_BL.shape
  positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
  return model(input_ids_BL, positions_BL, token_type_ids_BL=token_type_ids_BL, deterministic=True)


def load_hf_roformer(path, **overrides) -> HFRoFormer:
  """Loads an HF RoFormerForMaskedLM directory (config.json + model.safetensors) without torch.

  Args:
    path: the directory written by `save_pretrained`.
    **overrides: parameter-free ModelConfig fields (OVERRIDABLE_FIELDS), e.g. `dtype="bfloat16"`.

  Returns:
    HFRoFormer: `model(input_ids [B, L], token_type_ids=None) -> float32 MLM logits [B, L, V]`,
    equal to the HF model's logits in eval mode; `.model` is the Encoder, `.config` its config.

  Raises:
    HFConversionError: for an unsupported config (rotary_value, hidden_act, decoder) or a
      missing, mis-shaped, non-finite or unused tensor, naming it.
  """
  hf_config = read_hf_config(path)
  cfg = hf_config_to_model_config(hf_config, **overrides)
  tensors = load_hf_tensors(path)
  graphdef, flat, param_shapes = abstract_params(cfg)
  max_len = {**_HF_DEFAULTS, **hf_config}["max_position_embeddings"]
  params = hf_tensors_to_params(tensors, cfg, param_shapes, max_position_embeddings=max_len)
  return HFRoFormer(fill_model(graphdef, flat, params, cfg), cfg, max_len)
