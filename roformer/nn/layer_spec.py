"""What differs between the layers of a model, resolved once from the config's patterns.

Five fields describe layers that differ: posenc.layer_pattern and posenc.max_wavelength_pattern
(each layer's encoding and RoPE base), posenc.query_scale_kinds (which layers scale their
queries), model.attention_window_pattern (each layer's window) and model.qk_norm_kinds (which
layers normalise queries and keys). A ModelConfig turns them into one `LayerSpec` per layer when
it is built (`ModelConfig.layers`); each block receives its spec, and nothing downstream reads
the pattern strings again. The strings themselves are split by `roformer.posenc.layers`
(`pattern_kinds`, `pattern_bases`, `kind_list`, `int_list`), the one parser of all five.
"""

import dataclasses

from roformer.posenc import layer_configs
from roformer.posenc.config import PosEncConfig
from roformer.posenc.layers import int_list, kind_list


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One layer's settings.

  Attributes:
    index: the layer's index.
    posenc: its encoding config: kind, RoPE base and query temperature (`layer_configs`).
    window: its attention window (0 = all keys), of kind `window_kind`.
    window_kind: "sliding", "blockwise" or "chunked" (model.attention_window_kind).
    qk_norm: model.qk_norm, or "none" where model.qk_norm_kinds leaves the layer out.
    causal: whether it attends causally (a decoder's layers).
  """

  index: int
  posenc: PosEncConfig
  window: int
  window_kind: str
  qk_norm: str
  causal: bool


def layer_specs(cfg) -> tuple[LayerSpec, ...]:
  """The LayerSpec of every layer of a ModelConfig whose fields were checked (its patterns
  parse)."""
  posencs = layer_configs(cfg.posenc, cfg.num_layers)
  windows = int_list(cfg.attention_window_pattern) or (cfg.attention_window,)
  normed = kind_list(cfg.qk_norm_kinds)
  return tuple(
    LayerSpec(
      index=i,
      posenc=posenc,
      window=windows[i % len(windows)],
      window_kind=cfg.attention_window_kind,
      qk_norm=cfg.qk_norm if not normed or posenc.kind in normed else "none",
      causal=cfg.kind == "decoder",
    )
    for i, posenc in enumerate(posencs)
  )
