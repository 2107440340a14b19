"""Decoder language model (causal LM) on the Python standard library, RoPE by default.

Run: python train.py --config=configs/lm.py --workdir=DIR [--config.posenc.kind=alibi]
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.kind = "decoder"
  config.model.num_layers = 6
  config.model.emb_dim = 512
  config.model.num_heads = 8
  config.model.mlp_dim = 2048
  config.data.seq_len = 512
  config.train.global_batch_size = 32
  config.train.num_train_steps = 50_000
  return config
