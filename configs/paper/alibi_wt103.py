"""The ALiBi paper's WikiText-103 language model (Press et al. 2022, section 4), L = 512.

Run: python train.py --config=configs/paper/alibi_wt103.py --workdir=DIR [--config.posenc.kind=rope]
(`experiments/extrapolation.py --scale=paper` trains every encoding with it.)

As the paper (fairseq `transformer_lm_wiki103`): 16 pre-LN layers, d = 1024, 8 heads, FFN 4096,
dropout 0.3, token embeddings N(0, 1/d) times sqrt(d), no weight decay, 286k updates of
8 x 9216 tokens. Deliberate differences (docs/fidelity.md): a 32k BPE vocabulary with a tied
softmax instead of the word-level vocabulary with adaptive input and softmax; AdamW with cosine
decay instead of NAG; one dropout rate (fairseq: 0.1 on attention and activations); a final
LayerNorm (fairseq's wiki103 architecture has none).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.kind = "decoder"
  config.model.num_layers = 16
  config.model.emb_dim = 1024
  config.model.num_heads = 8
  config.model.mlp_dim = 4096
  config.model.dropout_rate = 0.3
  config.model.embed_scale = "sqrt_d"
  config.model.attention_impl = "auto"
  config.posenc.kind = "alibi"
  config.posenc.max_len = 512
  config.data.source = "hub"
  config.data.hub_name = "Salesforce/wikitext"
  config.data.hub_config = "wikitext-103-raw-v1"
  config.data.tokenizer = "bpe"
  config.data.vocab_size = 32768
  config.data.seq_len = 512
  config.optim.learning_rate = 3e-4
  config.optim.warmup_steps = 16_000
  config.optim.weight_decay = 0.0
  config.optim.b2 = 0.98
  config.train.global_batch_size = 144  # 73,728 tokens per update, as 8 GPUs x 9216 tokens
  config.train.num_train_steps = 286_000
  config.train.eval_every_steps = 10_000
  config.train.checkpoint_every_steps = 5_000
  config.mesh.data = -1
  return config
