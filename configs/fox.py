"""FoX, the Forgetting Transformer (Lin et al. 2025, arXiv 2503.02130): softmax attention with a
per-head forget gate and no positional encoding.

The arm `fox` of configs/arms.py: the paper's base FoX (not its "Pro" block, which adds output
gates, output norms, QK-norm and key/value shifts): every layer's logits are decayed by the
forget gates between query and key (`model.forget_gate`, roformer/nn/attention/forget_gate.py),
with NoPE, as the paper's code runs it by default (use_rope=False). Model and data are
default.py's, so runs compare with the other encodings at one budget.
Run: python train.py --config=configs/fox.py --workdir=DIR
"""

from configs import arms, default


def get_config():
  return arms.apply(default.get_config(), "fox")
