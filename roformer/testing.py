"""Builders shared by the tests (and handy in a notebook): encodings as a model would build them."""

from flax import nnx

from roformer import posenc
from roformer.posenc.config import PosEncConfig


def build_posenc(kind="rope", *, num_heads=4, head_dim=16, emb_dim=64, causal=True, **fields):
  """Validates and builds an encoding outside any mesh, as a model does (its ModelConfig checks
  the posenc when built); parameters keep their logical axes as metadata."""
  cfg = PosEncConfig(kind=kind, **fields)
  posenc.validate_posenc(cfg, causal=causal, head_dim=head_dim)
  with nnx.use_eager_sharding(False):
    return posenc.make_posenc(
      cfg, num_heads=num_heads, head_dim=head_dim, emb_dim=emb_dim, causal=causal, rngs=nnx.Rngs(0)
    )
