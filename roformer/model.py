"""RoFormer models: Encoder (masked LM) and Decoder (causal LM), their blocks and heads."""

import dataclasses

from roformer.posenc_config import PosEncConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  kind: str = "decoder"  # encoder (MLM) | decoder (causal LM)
  vocab_size: int = 259  # from the tokenizer
  num_layers: int = 2
  emb_dim: int = 128
  num_heads: int = 4
  num_kv_heads: int = 0  # 0 = num_heads (MHA); 1 = MQA; else GQA
  head_dim: int = 0  # 0 = emb_dim // num_heads
  mlp_dim: int = 512
  dropout_rate: float = 0.0
  activation: str = "gelu"  # gelu | swiglu
  norm: str = "layernorm"  # layernorm | rmsnorm
  norm_eps: float = 1e-12
  pre_norm: bool = False  # encoder only: False = post-LN (BERT/RoFormer); decoders are always pre-LN
  use_bias: bool = True
  tie_embeddings: bool = True
  embedding_size: int = 0  # 0 = emb_dim; else embeddings are projected up (HF `embeddings_project`)
  type_vocab_size: int = 0  # 0 = no token-type embeddings (HF RoFormer has 2)
  dtype: str = "float32"  # compute dtype: float32 | bfloat16
  param_dtype: str = "float32"
  attention_impl: str = "auto"  # dense | chunked | auto
  attention_block: int = 512  # query/key block of the chunked kernel, and sequence block of blockwise eval
  posenc: PosEncConfig = PosEncConfig()
