"""The ALiBi paper's WikiText-103 language model at L = 1024 (configs/paper/alibi_wt103.py)."""

from configs.paper import alibi_wt103


def get_config():
  config = alibi_wt103.get_config()
  config.data.seq_len = 1024
  config.posenc.max_len = 1024
  config.train.global_batch_size = 72  # the same 73,728 tokens per update
  return config
