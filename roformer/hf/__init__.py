"""Importers of Hugging Face checkpoints (config.json + safetensors), no torch.

`load_hf_roformer` rebuilds a RoFormerForMaskedLM as this library's Encoder; `load_hf_decoder`
rebuilds a Llama, Mistral, Qwen2 or GPT-NeoX causal LM as its Decoder.
"""

from roformer.hf.checkpoint import (
  OVERRIDABLE_FIELDS,
  HFConversionError,
  load_hf_tensors,
  read_hf_config,
)
from roformer.hf.decoders import DECODER_MODEL_TYPES, hf_decoder_config, load_hf_decoder
from roformer.hf.roformer import (
  HF_ACTIVATIONS,
  HFRoFormer,
  hf_config_to_model_config,
  hf_tensors_to_params,
  load_hf_roformer,
)

__all__ = [
  "DECODER_MODEL_TYPES",
  "HF_ACTIVATIONS",
  "OVERRIDABLE_FIELDS",
  "HFConversionError",
  "HFRoFormer",
  "hf_config_to_model_config",
  "hf_decoder_config",
  "hf_tensors_to_params",
  "load_hf_decoder",
  "load_hf_roformer",
  "load_hf_tensors",
  "read_hf_config",
]
