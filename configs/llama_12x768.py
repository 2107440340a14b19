"""The 12-layer, 768-wide Llama-style decoder of the GPU figures (docs/gpu.md, gpu_check.py):
SwiGLU 2048, RMSNorm, no biases, untied embeddings, bf16 compute with float32 parameters, RoPE
in the half layout, on configs/lm.py; 16 x 2048 bytes a step.

Run: python -m benchmarks.tpu_compile --config=configs/llama_12x768.py --topology=h100
     python train.py --config=configs/llama_12x768.py --workdir=/tmp/llama_12x768
"""

from configs import lm

# As --config.group.field overrides of configs/lm.py (the benchmarks apply them to other shapes).
FIELDS = {
  "model.num_layers": 12,
  "model.emb_dim": 768,
  "model.num_heads": 12,
  "model.mlp_dim": 2048,
  "model.activation": "swiglu",
  "model.norm": "rmsnorm",
  "model.use_bias": False,
  "model.tie_embeddings": False,
  "model.dropout_rate": 0.0,
  "model.dtype": "bfloat16",
  "posenc.kind": "rope",
  "posenc.rope_layout": "half",
  "data.tokenizer": "bytes",
}


def get_config():
  config = lm.get_config()
  for name, value in FIELDS.items():
    group, field = name.split(".")
    config[group][field] = value
  config.data.seq_len = 2048
  config.train.global_batch_size = 16
  return config
