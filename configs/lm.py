"""Decoder language model (causal LM) on the Python standard library, RoPE by default.

The model and data are default.py's; this file sets the batch and the number of steps.
Run: python train.py --config=configs/lm.py --workdir=DIR [--config.posenc.kind=alibi]
"""

from configs import default


def get_config():
  config = default.get_config()
  config.train.global_batch_size = 32
  config.train.num_train_steps = 50_000
  return config
