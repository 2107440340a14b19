"""A small decoder (299k parameters) trained to copy strings of 8..32 symbols (synthetic data).

Run: python train.py --config=configs/synthetic_copy.py --workdir=/tmp/copy
Then: python eval.py --workdir=/tmp/copy --task_lengths=8,16,32,64,128,256
Measured (2-core CPU under load, 5.5 minutes): exact match 0.13 / 0.09 / 0.00 and per-token
accuracy 0.74 / 0.85 / 0.40 at lengths 8 / 16 / 32, still improving when the 1200 steps ended;
it does not yet reach the 95% exact match at 32 this config is meant for (see docs/synthetic.md).
Any encoding: --config.posenc.kind=alibi (etc.);
randomized positions: --config.posenc.randomize_max=N.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.num_layers = 2
  config.model.emb_dim = 128
  config.model.num_heads = 4
  config.model.mlp_dim = 256
  config.model.attention_impl = "auto"
  config.model.attention_block = 128
  config.posenc.kind = "rope"
  config.data.source = "synthetic"
  config.data.task = "copy"
  config.data.task_min_len = 8
  config.data.task_max_len = 32
  config.data.seq_len = 64  # an example of 32 letters is 65 tokens: 64 inputs
  config.optim.learning_rate = 2e-3
  config.optim.warmup_steps = 50
  config.optim.weight_decay = 0.0
  config.train.global_batch_size = 32
  config.train.num_train_steps = 1200
  config.train.log_every_steps = 100
  config.train.eval_every_steps = 0
  config.train.eval_max_tokens = 4096
  config.train.checkpoint_every_steps = 300
  return config
