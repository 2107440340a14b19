"""The model: encoder and decoder stacks, their layers and attention (roformer/nn/attention/).

Positions enter only through a `roformer.posenc` encoding; nothing here reads a run config, data
or devices.
"""

from roformer.nn.config import ModelConfig, validate_model
from roformer.nn.model import Decoder, Encoder, make_model

__all__ = ["Decoder", "Encoder", "ModelConfig", "make_model", "validate_model"]
