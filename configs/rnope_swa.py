"""RNoPE-SWA ("Rope to Nope and Back Again", Yang et al. 2025, arXiv 2501.18795): RoPE layers
with a sliding window, NoPE layers with full attention.

Three local RoPE layers per global NoPE layer, the interleaving of the paper's hybrid (and of
Cohere's Command A, built on it); the window is data.seq_len / 4 as set here (a run at another
length sets model.attention_window_pattern with it). Model and data are default.py's, so runs
compare with the other encodings at one budget.
Run: python train.py --config=configs/rnope_swa.py --workdir=DIR
"""

from configs import default


def get_config():
  config = default.get_config()
  window = config.data.seq_len // 4
  config.posenc.kind = "rope"
  config.posenc.layer_pattern = "rope,rope,rope,nope"
  config.model.attention_window_pattern = f"{window},{window},{window},0"
  config.model.attention_window_kind = "sliding"
  return config
