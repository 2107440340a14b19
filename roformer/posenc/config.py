"""Frozen configuration of the positional encodings (the library never sees a ConfigDict)."""

import dataclasses

ROPE_LAYOUTS = ("interleaved", "half")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE context-extension scaling; `kind="none"` leaves the frequencies alone.

  Zero means "not set" for `original_max_len` (then the run's training length is used),
  `mscale` and `mscale_all_dim` (then YaRN's attention factor is 0.1 ln(factor) + 1), and
  `attention_factor` (then LongRoPE's is sqrt(1 + ln(factor) / ln(original_max_len))).
  `short_factor` and `long_factor` are LongRoPE's per-dimension divisors of the frequencies
  (head_dim / 2 each, Hugging Face's `longrope` lists), for lengths up to and beyond
  `original_max_len`.
  """

  kind: str = "none"
  factor: float = 1.0
  original_max_len: int = 0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  short_factor: tuple[float, ...] = ()
  long_factor: tuple[float, ...] = ()
  attention_factor: float = 0.0

  def __post_init__(self):
    # Lists (config.json) become tuples of floats: the config stays hashable.
    for name in ("short_factor", "long_factor"):
      object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

  def as_mapping(self) -> dict | None:
    """The mapping `rope_frequencies(scaling=...)` takes, or None for kind "none"."""
    return None if self.kind == "none" else dataclasses.asdict(self)


# Training-free context extensions (roformer/posenc/extension.py); "none" leaves positions alone.
EXTENSION_KINDS = ("none", "self_extend", "dca", "rerope", "string", "sinks")


# The ContextExtension fields each kind reads.
EXTENSION_FIELDS = {
  "self_extend": ("window", "group"),
  "dca": ("chunk", "local"),
  "rerope": ("window",),
  "string": ("shift", "local"),
  "sinks": ("sinks", "window"),
}
# Read fields that may stay 0: DCA's local window, STRING's local value, the number of sinks.
_MAY_BE_ZERO = ("local", "sinks")


@dataclasses.dataclass(frozen=True)
class ContextExtension:
  """A training-free context extension: the relative position (or the mask) of each
  (query, key) pair is remapped at evaluation (`roformer.posenc.extension`).

  Which fields a kind reads (each must then be set; 0 means "not set"):
    self_extend: window (neighbour window W), group (group size G).
    dca: chunk (chunk length s), local (local window w).
    rerope: window (the clamp w).
    string: shift (shifted offset S), local (local value W < S).
    sinks: sinks (first tokens kept), window (recent keys, the query included).
  """

  kind: str = "none"
  window: int = 0
  group: int = 0
  chunk: int = 0
  local: int = 0
  shift: int = 0
  sinks: int = 0

  def __post_init__(self):
    if self.kind not in EXTENSION_KINDS:
      raise ValueError(f"posenc.extension.kind={self.kind!r} is not one of {EXTENSION_KINDS}")
    for name in ("window", "group", "chunk", "local", "shift", "sinks"):
      if getattr(self, name) < 0:
        raise ValueError(f"posenc.extension.{name}={getattr(self, name)} must be >= 0")
    needs = [f for f in EXTENSION_FIELDS.get(self.kind, ()) if f not in _MAY_BE_ZERO]
    for name in needs:
      if getattr(self, name) < 1:
        raise ValueError(
          f"posenc.extension.kind={self.kind!r} needs posenc.extension.{name} >= 1 "
          f"(eval.py --extend_{name})"
        )
    if self.kind == "string" and self.local >= self.shift:
      raise ValueError(
        f"posenc.extension.local={self.local} must be below posenc.extension.shift="
        f"{self.shift} for kind 'string' (shifted distances d - shift + local must shrink)"
      )


@dataclasses.dataclass(frozen=True)
class PosEncConfig:
  kind: str = "rope"
  max_len: int = 512  # learned: size of the position table
  max_wavelength: float = 10000.0  # RoPE/xPos base b in theta_i = b^(-2i/d); sinusoidal, pope
  rope_layout: str = "interleaved"  # interleaved: pairs (2i, 2i+1); half: pairs (i, i + d/2)
  rope_fraction: float = 1.0  # fraction of each head's dimensions that rotate
  t5_num_buckets: int = 32
  t5_max_distance: int = 128
  xpos_gamma: float = 0.4
  xpos_scale_base: float = 512.0
  scaling: RopeScaling = RopeScaling()
  # Training-free context extension (rotary encodings, decoders; usually set at evaluation).
  extension: ContextExtension = ContextExtension()
  rope_truncate: float = 0.0  # p-RoPE: fraction of the lowest frequencies that do not rotate
  rope_resonance: bool = False  # Resonance RoPE: wavelengths 2 pi / theta rounded to integers
  randomize_max: int = 0  # positions: sorted random subsets of [0, N), also at eval; 0 = off
  fire_mlp_width: int = 32  # fire: hidden width of the MLP
  fire_init_c: float = 0.1  # fire: initial c of psi(x) = log(c x + 1)
  fire_init_threshold: float = 512.0  # fire: initial threshold L of the normaliser max(L, i)
  fire_shared: bool = False  # fire: one MLP for all layers (FIRE-S) instead of one per layer
  sandwich_dim: int = 0  # sandwich: dimension d' of the sinusoids; 0 = model.emb_dim
  cope_npos_max: int = 0  # cope: position embeddings; 0 = data.seq_len + 1 (or max_len + 1)
  cope_shared: bool = False  # cope: one table for all layers instead of one per layer
  pope_bias_init: str = "zeros"  # pope: key phase bias delta at 0, or "uniform" in [-2 pi, 0]
  # Per-layer encodings (posenc/layers.py): kinds "k1,k2,..." and RoPE bases "b1,b2,...", each
  # repeated over the layers; "" = every layer uses `kind` and `max_wavelength`.
  layer_pattern: str = ""
  max_wavelength_pattern: str = ""
  # Query temperature (posenc/query_scale.py): none | logn | ssmax | llama4.
  query_scale: str = "none"
  query_scale_len: int = 0  # logn: the training length L0; 0 = data.seq_len
  query_scale_beta: float = 0.1  # llama4: beta of 1 + beta log(floor((p + 1) / floor) + 1)
  query_scale_floor: float = 8192.0  # llama4: floor_scale
  # Kinds (of posenc.layer_pattern) whose layers scale their queries; "" = every layer.
  query_scale_kinds: str = ""
