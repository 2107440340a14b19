"""Every configuration field with its default; other configs import this and override a few.

Run: python train.py --config=configs/default.py --workdir=DIR [--config.group.field=value ...]

Each group is built from the dataclass the library turns it into, so a field's default and doc
live in one place, its declaration `param(default, doc)`: ModelConfig (roformer/nn/config.py),
PosEncConfig and the encodings' `Fields` (roformer/posenc/), DataConfig (roformer/data/config.py),
OptimConfig and TrainConfig (roformer/config.py), MeshConfig (roformer/infra/sharding.py).
docs/reference/config.md lists every field with its default and doc (`python -m configs.reference`
writes it).
"""

import ml_collections

from roformer.config import group_defaults, posenc_defaults
from roformer.infra.sharding import MeshConfig

# The groups in order, each with what it holds (the sections of docs/reference/config.md).
GROUPS = {
  "model": "the Transformer (the vocabulary size comes from the tokenizer)",
  "posenc": "the positional encoding (posenc.kind picks it)",
  "data": "corpus, tokenizer and windows",
  "optim": "AdamW with warmup then decay",
  "train": "the loop",
  "mesh": "device mesh and parameter sharding",
}

# Logical parameter axis -> mesh axes: mesh.rules's default.
DEFAULT_RULES = MeshConfig.rules


def get_config() -> ml_collections.ConfigDict:
  """The default configuration: a 6-layer RoPE decoder LM on the Python standard library bytes."""
  config = ml_collections.ConfigDict()
  for group in GROUPS:
    # posenc: the encodings' own declarations (each PosEnc's `Fields`, and the cross-cutting
    # fields of roformer/posenc/config.py), so an encoding registered by a module the config file
    # imported brings its fields along; `python -m roformer.posenc` lists them.
    defaults = posenc_defaults() if group == "posenc" else group_defaults(group)
    config[group] = ml_collections.ConfigDict(defaults)
  config.lock()
  return config
