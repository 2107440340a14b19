"""Llama 4's iRoPE decoder: NoPE every fourth layer, chunked local attention on the RoPE layers.

The positional and attention choices of Llama 4 (Hugging Face transformers `Llama4TextConfig`
and `Llama4TextAttention`), on default.py's model and data so runs compare with the other
encodings at one budget:
- layers "rope,rope,rope,nope" (`no_rope_layers`: every fourth layer has no RoPE);
- the RoPE layers attend within chunks (`attention_chunk_size`, 8192 of 256K in Llama 4; here
  data.seq_len / 4), the NoPE layers to every earlier token;
- RoPE base 500,000 (`rope_theta`), interleaved pairs (Llama 4's complex `freqs_cis`);
- L2 QK-norm after RoPE on the RoPE layers only (`use_qk_norm`, `Llama4TextL2Norm`);
- query temperature 1 + 0.1 ln(floor((pos + 1) / floor_scale) + 1) on the NoPE layers only
  (`attn_temperature_tuning`), floor_scale = the chunk (8192 in Llama 4).
The chunk and the floor follow data.seq_len as set here; a run at another length sets
model.attention_window_pattern and posenc.query_scale_floor with it.
Run: python train.py --config=configs/irope.py --workdir=DIR
"""

from configs import default


def get_config():
  config = default.get_config()
  chunk = config.data.seq_len // 4
  config.posenc.kind = "rope"
  config.posenc.layer_pattern = "rope,rope,rope,nope"
  config.posenc.max_wavelength = 500_000.0
  config.model.attention_window_pattern = f"{chunk},{chunk},{chunk},0"
  config.model.attention_window_kind = "chunked"
  config.model.qk_norm = "l2"
  config.model.qk_norm_kinds = "rope"
  config.posenc.query_scale = "llama4"
  config.posenc.query_scale_kinds = "nope"
  config.posenc.query_scale_floor = float(chunk)
  return config
