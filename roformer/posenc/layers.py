"""Per-layer encodings: `posenc.layer_pattern` and `posenc.max_wavelength_pattern`.

A pattern gives layer i the kind `kinds[i % len(kinds)]` and the RoPE base
`bases[i % len(bases)]`, repeated over the layers as `model.attention_window_pattern` is: Llama 4's
iRoPE ("rope,rope,rope,nope": NoPE every fourth layer), RNoPE ("rope,nope") and Gemma's local and
global bases ("10000,...,1000000"). Each layer then has an encoding of its own, built from its
layer config (`layer_config`) by the registry, and used through the usual hooks: the model's
encoding is a `LayerPattern` that prepares every layer's rotary state once per pass and hands
layer i its encoding (`layer(i)`) and state (`layer_state(state, i)`).

Only encodings that act inside attention (rotate, bias, content bias) can differ between layers.
An absolute encoding is added once to the token embeddings, before any layer: there is no layer
for it to be "on", so a pattern naming one is refused.
"""

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from roformer.posenc.base import PosEnc
from roformer.posenc.config import PosEncConfig, RopeScaling


def has_pattern(cfg: PosEncConfig) -> bool:
  return bool(cfg.layer_pattern or cfg.max_wavelength_pattern)


def pattern_kinds(cfg: PosEncConfig) -> tuple[str, ...]:
  """The kinds of `layer_pattern` in order ((kind,) without one)."""
  return kind_list(cfg.layer_pattern) or (cfg.kind,)


def pattern_bases(cfg: PosEncConfig) -> tuple[float, ...]:
  """The RoPE bases of `max_wavelength_pattern` in order ((max_wavelength,) without one)."""
  return tuple(float(b) for b in kind_list(cfg.max_wavelength_pattern)) or (cfg.max_wavelength,)


def period(cfg: PosEncConfig) -> int:
  """Layers after which the two patterns repeat together (the lcm of their lengths)."""
  return math.lcm(len(pattern_kinds(cfg)), len(pattern_bases(cfg)))


def layer_config(cfg: PosEncConfig, i: int, *, accepts_rope_scaling=None) -> PosEncConfig:
  """The encoding config of layer i: its kind and base, no pattern, and its own query scale.

  The RoPE options (base, scaling, rope_truncate, rope_resonance) apply to the rotary layers of
  a pattern; a layer whose kind takes no RoPE scaling (`accepts_rope_scaling(kind)` False)
  keeps their defaults. The
  query temperature applies to the layers whose kind is in `query_scale_kinds` ("" = all); the
  others get `query_scale="none"`.
  """
  kinds, bases = pattern_kinds(cfg), pattern_bases(cfg)
  kind = kinds[i % len(kinds)]
  scaled = not cfg.query_scale_kinds or kind in kind_list(cfg.query_scale_kinds)
  layer = dataclasses.replace(
    cfg, kind=kind, max_wavelength=bases[i % len(bases)], layer_pattern="",
    max_wavelength_pattern="", query_scale=cfg.query_scale if scaled else "none",
    query_scale_kinds="",
  )  # fmt: skip
  if has_pattern(cfg) and accepts_rope_scaling is not None and not accepts_rope_scaling(kind):
    # Its base is unused too: one entry serves all such layers of a kind.
    layer = dataclasses.replace(
      layer,
      scaling=RopeScaling(),
      rope_truncate=0.0,
      rope_resonance=False,
      max_wavelength=cfg.max_wavelength,
    )
  return layer


def kind_list(kinds: str) -> tuple[str, ...]:
  """The kinds of a comma-separated list ("k1,k2" -> ("k1", "k2"); "" -> ())."""
  return tuple(k.strip() for k in kinds.split(",")) if kinds else ()


def int_list(text: str) -> tuple[int, ...]:
  """The integers >= 0 of a comma-separated list ("4096,0" -> (4096, 0); "" -> ()).

  Raises:
    ValueError: an entry is not a non-negative integer.
  """
  entries = kind_list(text)
  if not all(e.isdigit() for e in entries):
    raise ValueError(f"{text!r} is not a comma-separated list of integers >= 0")
  return tuple(int(e) for e in entries)


def parse_error(cfg: PosEncConfig, known_kinds) -> str | None:
  """One line naming what is wrong with the patterns' syntax or kinds, or None."""
  if cfg.layer_pattern:
    kinds = pattern_kinds(cfg)
    unknown = [k for k in kinds if k not in known_kinds]
    if unknown:
      return (
        f"posenc.layer_pattern={cfg.layer_pattern!r} names unknown kind(s) {unknown}; "
        f"kinds are {tuple(known_kinds)}, comma-separated, e.g. 'rope,rope,rope,nope' (an "
        "encoding of your own registers with @roformer.posenc.register in a module the config "
        "file imports)"
      )
    if cfg.kind not in kinds:
      return (
        f"posenc.kind={cfg.kind!r} is not in posenc.layer_pattern={cfg.layer_pattern!r}: with a "
        f"pattern, posenc.kind names the model's main encoding (its paper's embedding scale, "
        f"evaluation labels) and must be one of {sorted(set(kinds))}"
      )
  if cfg.max_wavelength_pattern:
    try:
      bases = pattern_bases(cfg)
    except ValueError:
      bases = ()
    if not bases or not all(b > 1 for b in bases):
      return (
        f"posenc.max_wavelength_pattern={cfg.max_wavelength_pattern!r} must be comma-separated "
        "RoPE bases > 1, e.g. '10000,10000,10000,10000,10000,1000000'"
      )
  return None


class LayerPattern(PosEnc):
  """The model's encoding under a pattern: one encoding per distinct layer config.

  Layer i uses `layer(i)` (built from `layer_config(cfg, i)` by the registry) with
  `layer_state(prepare(kpos), i)`. `embed` is the identity (absolute encodings cannot be per
  layer). The entries are made by `posenc.make_posenc`, which owns the registry.
  """

  def __init__(self, cfg: PosEncConfig, entries: list[PosEnc], index: tuple[int, ...], **kwargs):
    super().__init__(cfg, **kwargs)
    self.entries = nnx.List(entries)
    self.index = index  # layer i % period -> entry

  def layer(self, i: int) -> PosEnc:
    return self.entries[self.index[i % len(self.index)]]

  def prepare(self, kpos_BS: jax.Array) -> tuple:
    """Every entry's rotary state, from the pass's key positions."""
    return tuple(e.prepare(kpos_BS) for e in self.entries)

  def layer_state(self, state: Any, i: int) -> Any:
    return None if state is None else state[self.index[i % len(self.index)]]
