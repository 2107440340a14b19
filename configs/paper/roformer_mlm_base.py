"""The RoFormer paper's masked-LM comparison at BERT-base size (Su et al. 2021, Fig. 3).

Run: python train.py --config=configs/paper/roformer_mlm_base.py --workdir=DIR
     [--config.posenc.kind=learned]   (BERT's learned positions against RoFormer's rotary ones)
(`experiments/mlm.py --scale=paper` trains every encoding with it.)

As BERT-base / RoFormer: 12 post-LN layers, d = 768, 12 heads, FFN 3072, dropout 0.1, N(0, 0.02)
embeddings, length 512, 15% masking 80/10/10, AdamW (b2 0.999, weight decay 0.01 off norms and
biases), linear decay. Deliberate differences (docs/fidelity.md): English Wikipedia with a 30k
WordPiece vocabulary instead of Chinese words; trained from scratch (RoFormer's MLM run was
initialised from WoBERT).
"""

from configs import mlm


def get_config():
  config = mlm.get_config()
  config.model.num_layers = 12
  config.model.emb_dim = 768
  config.model.num_heads = 12
  config.model.mlp_dim = 3072
  config.model.dropout_rate = 0.1
  config.posenc.kind = "rope"
  config.posenc.max_len = 512
  config.data.source = "hub"
  config.data.hub_name = "wikimedia/wikipedia"
  config.data.hub_config = "20231101.en"
  config.data.hub_validation_split = ""
  config.data.hub_test_split = ""
  config.data.tokenizer = "wordpiece"
  config.data.vocab_size = 30522
  config.data.seq_len = 512
  config.optim.learning_rate = 1e-4
  config.optim.warmup_steps = 10_000
  config.train.global_batch_size = 256
  config.train.num_train_steps = 1_000_000
  config.train.eval_every_steps = 10_000
  config.train.checkpoint_every_steps = 5_000
  return config
