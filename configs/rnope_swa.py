"""RNoPE-SWA ("Rope to Nope and Back Again", Yang et al. 2025, arXiv 2501.18795): RoPE layers
with a sliding window, NoPE layers with full attention.

The arm `rnope_swa` of configs/arms.py: three local RoPE layers per global NoPE layer, the
interleaving of the paper's hybrid (and of Cohere's Command A, built on it); the window is
data.seq_len / 4 as set here (a run at another length sets model.attention_window_pattern with
it). Model and data are default.py's, so runs compare with the other encodings at one budget.
Run: python train.py --config=configs/rnope_swa.py --workdir=DIR
"""

from configs import arms, default


def get_config():
  return arms.apply(default.get_config(), "rnope_swa", nope_every=4)
