"""A small RoPE decoder (1.8M parameters) on the Python standard library's bytes.

Run: python train.py --config=configs/quickstart.py --workdir=/tmp/quickstart
700 steps of 16 x 128 bytes; its time and validation loss are in the README's quickstart.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.num_layers = 4
  config.model.emb_dim = 192
  config.model.num_heads = 4
  config.model.mlp_dim = 768
  config.model.attention_impl = "dense"
  config.data.seq_len = 128
  config.optim.learning_rate = 1.5e-3
  config.optim.warmup_steps = 30
  config.train.global_batch_size = 16
  config.train.num_train_steps = 700
  config.train.log_every_steps = 50
  config.train.eval_every_steps = 350
  config.train.eval_batch_size = 64
  config.train.checkpoint_every_steps = 350
  return config
