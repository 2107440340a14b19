"""The registry of attention kinds (`model.attention`): softmax, linear, multi-head latent.

Every kind is a module built by `from_config(cfg, spec, *, rngs)` (the model config and the
layer's LayerSpec, nn/layer_spec.py) and used by the model's blocks the same way:

- `__call__(x_BLD, pos_BL, posenc, *, cache=None, segment_ids_BL=None, dropout_key=None,
  rotary_state=None)` -> (heads [B, L, H, K], cache): the full forward pass without a cache
  (training, evaluation), a generation step with one (prefill when L > 1, from an empty cache).
- `out(o_BLHK)` -> [B, L, D]: the output projection, run by the block over sequence blocks.
- `init_cache(batch, max_len)`: an empty decoding cache.
- `check_config(cfg, posenc_cls)` (classmethod): combinations this kind cannot honour.
- `rotary_head_dim(cfg, head_dim)` (classmethod): the width the encoding's `rotate` acts on.

Positions reach every kind only through the encoding's hooks (prepare/rotate/bias/embed).
"""

from flax import nnx

from roformer.nn.attention.linear import LinearAttention
from roformer.nn.attention.mla import MLAttention
from roformer.nn.attention.softmax import Attention

ATTENTIONS: dict[str, type[nnx.Module]] = {
  "softmax": Attention,
  "linear": LinearAttention,
  "mla": MLAttention,
}


def make_attention(cfg, spec, *, rngs: nnx.Rngs) -> nnx.Module:
  """Builds `ATTENTIONS[cfg.attention]` for the layer `spec` (a LayerSpec) of the model `cfg`."""
  return ATTENTIONS[cfg.attention].from_config(cfg, spec, rngs=rngs)
