"""Encoder masked LM (BERT-style, post-LN as in RoFormer) with a WordPiece vocabulary.

Run: python train.py --config=configs/mlm.py --workdir=DIR [--config.posenc.kind=learned]
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.kind = "encoder"
  config.model.norm_eps = 1e-12
  config.model.dropout_rate = 0.1
  config.data.tokenizer = "wordpiece"
  config.optim.learning_rate = 1e-4
  config.optim.b2 = 0.999
  config.optim.weight_decay = 0.01
  config.optim.schedule = "linear"
  config.optim.final_learning_rate_fraction = 0.0
  return config
