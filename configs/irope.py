"""Llama 4's iRoPE decoder: NoPE every fourth layer, chunked local attention on the RoPE layers.

The arm `irope` of configs/arms.py (its fields and their Llama 4 names are there) on default.py's
model and data, so runs compare with the other encodings at one budget: layers
"rope,rope,rope,nope"; the RoPE layers attend within chunks of data.seq_len / 4 (8192 of 256K in
Llama 4), with RoPE base 500,000 and L2 QK-norm; the NoPE layers attend to every earlier token
with Llama 4's query temperature, whose floor is the chunk.
The chunk and the floor follow data.seq_len as set here; a run at another length sets
model.attention_window_pattern and posenc.query_scale_floor with it.
Run: python train.py --config=configs/irope.py --workdir=DIR
"""

from configs import arms, default


def get_config():
  return arms.apply(default.get_config(), "irope", nope_every=4)
