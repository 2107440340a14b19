"""Frozen configuration of the positional encodings (the library never sees a ConfigDict)."""

import dataclasses

ROPE_LAYOUTS = ("interleaved", "half")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE context-extension scaling; `kind="none"` leaves the frequencies alone.

  Zero means "not set" for `original_max_len` (then the run's training length is used),
  `mscale` and `mscale_all_dim` (then YaRN's attention factor is 0.1 ln(factor) + 1).
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

  def as_mapping(self) -> dict | None:
    """The mapping `rope_frequencies(scaling=...)` takes, or None for kind "none"."""
    return None if self.kind == "none" else dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PosEncConfig:
  kind: str = "rope"
  max_len: int = 512  # learned: size of the position table
  max_wavelength: float = 10000.0  # RoPE/xPos base b in theta_i = b^(-2i/d); sinusoidal too
  rope_layout: str = "interleaved"  # interleaved: pairs (2i, 2i+1); half: pairs (i, i + d/2)
  rope_fraction: float = 1.0  # fraction of each head's dimensions that rotate
  t5_num_buckets: int = 32
  t5_max_distance: int = 128
  xpos_gamma: float = 0.4
  xpos_scale_base: float = 512.0
  scaling: RopeScaling = RopeScaling()
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
