"""A small ALiBi decoder (3 layers x 128) trained to copy strings of 8..32 symbols (synthetic data).

Run: python train.py --config=configs/synthetic_copy.py --workdir=/tmp/copy
Then: python eval.py --workdir=/tmp/copy --task_lengths=8,16,24,32,64,128,256 --task_examples=512
What it reaches, and why ALiBi: docs/synthetic.md ("Experiments").
Any encoding: --config.posenc.kind=rope (etc.);
randomized positions: --config.posenc.randomize_max=N.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.num_layers = 3
  config.model.emb_dim = 128
  config.model.num_heads = 4
  config.model.mlp_dim = 256
  config.model.attention_block = 128
  config.posenc.kind = "alibi"
  config.data.source = "synthetic"
  config.data.seq_len = 64  # an example of 32 letters is 65 tokens: 64 inputs
  config.optim.learning_rate = 1.5e-3
  config.optim.warmup_steps = 100
  config.optim.weight_decay = 0.0
  config.train.num_train_steps = 2000
  config.train.eval_every_steps = 0
  config.train.eval_max_tokens = 0  # the task evaluation is eval.py --task_lengths
  config.train.checkpoint_every_steps = 1000
  return config
