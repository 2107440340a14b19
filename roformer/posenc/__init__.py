"""Every positional encoding: pure math functions, small modules and one registry.

An encoding acts through up to three hooks of `PosEnc` (embed, rotate, bias); `POSENCS` maps
`posenc.kind` to its class and is the only switch on the kind. Every module of this package is
imported here, so an encoding registers itself (`@register("kind")` above its class) in its own
file; an encoding of the user's own registers the same way from any module
(roformer/posenc/registry.py, docs/extending.md).
"""

import dataclasses
import importlib
import pkgutil

import jax.numpy as jnp
from flax import nnx

from roformer.posenc.absolute import Learned, Sinusoidal, sinusoidal_embedding
from roformer.posenc.base import PosEnc
from roformer.posenc.config import ROPE_LAYOUTS, PosEncConfig, param
from roformer.posenc.cope import Cope
from roformer.posenc.fire import Fire
from roformer.posenc.kerple import Kerple
from roformer.posenc.layers import (
  LayerPattern,
  has_pattern,
  kind_list,
  layer_config,
  parse_error,
  pattern_kinds,
  period,
)
from roformer.posenc.nope import NoPE
from roformer.posenc.pope import Pope, pope_features, pope_frequencies
from roformer.posenc.query_scale import QUERY_SCALES, QueryScale, check_query_scale
from roformer.posenc.registry import (
  POSENCS,
  UnknownEncodingError,
  encoding_fields,
  fields_of,
  register,
  unknown_kind_message,
  unregister,
)
from roformer.posenc.relative import Alibi, T5Bias, alibi_slopes, t5_relative_bucket
from roformer.posenc.rope import (
  Rope,
  XPos,
  apply_rotary,
  rope_long_term_decay,
  rope_sin_cos,
  rotary_dims,
)
from roformer.posenc.rope_scaling import SCALING_KINDS, check_scaling, rope_frequencies
from roformer.posenc.sandwich import Sandwich

# The built-in encodings register when their modules are imported: import every module of the
# package, so a new file with a registered class needs no line here.
for _module in pkgutil.iter_modules(__path__):
  if not _module.name.startswith("_"):
    importlib.import_module(f"{__name__}.{_module.name}")


def validate_posenc(
  cfg: PosEncConfig,
  *,
  causal: bool,
  head_dim: int,
) -> None:
  """Raises ValueError, naming the config field and its allowed values, for a bad posenc config.

  Args:
    cfg: the positional-encoding config.
    causal: True for a decoder, False for an encoder.
    head_dim: the model's per-head dim (model.head_dim after its default is resolved).
  """
  if cfg.kind not in POSENCS:
    raise UnknownEncodingError(unknown_kind_message(cfg.kind))
  if has_pattern(cfg) and (error := parse_error(cfg, POSENCS)):
    raise ValueError(error)
  check_query_scale(cfg, causal=causal)
  if cfg.query_scale_kinds:
    kinds = set(pattern_kinds(cfg))
    stray = [k for k in kind_list(cfg.query_scale_kinds) if k not in kinds]
    if stray or cfg.query_scale == "none":
      raise ValueError(
        f"posenc.query_scale_kinds={cfg.query_scale_kinds!r} must name kinds of the model's "
        f"layers {sorted(kinds)} and needs a posenc.query_scale other than 'none'"
      )
  if has_pattern(cfg):
    _validate_pattern(cfg, causal=causal, head_dim=head_dim)
    return
  if cfg.rope_layout not in ROPE_LAYOUTS:
    raise ValueError(f"posenc.rope_layout={cfg.rope_layout!r} is not one of {ROPE_LAYOUTS}")
  if cfg.scaling.kind not in SCALING_KINDS:
    raise ValueError(f"posenc.scaling.kind={cfg.scaling.kind!r} is not one of {SCALING_KINDS}")
  if not 0 < cfg.rope_fraction <= 1:
    raise ValueError(f"posenc.rope_fraction={cfg.rope_fraction} must be in (0, 1]")
  check_scaling(cfg.scaling, need_original_len=False)
  cls = POSENCS[cfg.kind]
  if not 0.0 <= cfg.rope_truncate < 1.0:
    raise ValueError(f"posenc.rope_truncate={cfg.rope_truncate} must be in [0, 1)")
  if cfg.rope_truncate and not issubclass(cls, Rope):
    raise ValueError(
      f"posenc.rope_truncate={cfg.rope_truncate} applies only to the rotary encodings "
      f"(posenc.kind in {tuple(k for k, c in POSENCS.items() if issubclass(c, Rope))}), "
      f"not posenc.kind={cfg.kind!r}; set it to 0"
    )
  if cfg.rope_resonance and not issubclass(cls, Rope):
    raise ValueError(
      f"posenc.rope_resonance=True rounds RoPE wavelengths and applies only to the rotary "
      f"encodings (posenc.kind in {tuple(k for k, c in POSENCS.items() if issubclass(c, Rope))}),"
      f" not posenc.kind={cfg.kind!r}; set it to False"
    )
  if cfg.randomize_max < 0:
    raise ValueError(f"posenc.randomize_max={cfg.randomize_max} must be >= 0 (0 = off)")
  if cfg.randomize_max and not cls.reads_positions:
    raise ValueError(
      f"posenc.randomize_max={cfg.randomize_max} randomizes the token positions, which "
      f"posenc.kind={cfg.kind!r} never reads (training would be unchanged); set it to 0"
    )
  if cls.causal_only and not causal:
    encoder_kinds = tuple(k for k, c in POSENCS.items() if not c.causal_only)
    raise ValueError(
      f"posenc.kind={cfg.kind!r} needs a causal decoder (model.kind='decoder'): "
      f"{cls.causal_reason}; for an encoder use posenc.kind in {encoder_kinds}"
    )
  if cfg.scaling.kind != "none" and not cls.accepts_rope_scaling:
    rotary = tuple(k for k, c in POSENCS.items() if c.accepts_rope_scaling)
    raise ValueError(
      f"posenc.scaling.kind={cfg.scaling.kind!r} applies only to the rotary encodings "
      f"(posenc.kind in {rotary}), not posenc.kind={cfg.kind!r}; "
      "set posenc.scaling.kind='none'"
    )
  if cfg.extension.kind != "none":
    if not cls.accepts_rope_scaling:
      rotary = tuple(k for k, c in POSENCS.items() if c.accepts_rope_scaling)
      raise ValueError(
        f"posenc.extension.kind={cfg.extension.kind!r} remaps rotary positions; it applies only "
        f"to posenc.kind in {rotary}, not {cfg.kind!r}"
      )
    if not causal:
      raise ValueError(
        f"posenc.extension.kind={cfg.extension.kind!r} remaps the positions of earlier keys; "
        "it needs a causal decoder (model.kind='decoder')"
      )
  cls.check_config(cfg, causal=causal, head_dim=head_dim)
  # Randomized training positions reach randomize_max - 1: a learned table must cover them.
  if cfg.randomize_max and (reason := cls.unsupported_length(cfg, cfg.randomize_max)):
    raise ValueError(reason)


def layer_configs(cfg: PosEncConfig, num_layers: int | None = None) -> tuple[PosEncConfig, ...]:
  """The encoding config of every layer (of one period of the patterns when num_layers is None)."""
  accepts = lambda kind: POSENCS[kind].accepts_rope_scaling  # noqa: E731
  n = period(cfg) if num_layers is None else num_layers
  return tuple(layer_config(cfg, i, accepts_rope_scaling=accepts) for i in range(n))


def _validate_pattern(cfg: PosEncConfig, *, causal: bool, head_dim: int):
  """`validate_posenc` of a per-layer pattern (its syntax already checked), then every layer."""
  kinds = pattern_kinds(cfg)
  absolute = sorted({k for k in kinds if POSENCS[k].embed is not PosEnc.embed})
  if absolute:
    field = "posenc.layer_pattern" if cfg.layer_pattern else "posenc.kind"
    raise ValueError(
      f"{field} names {absolute}, which add positions to the token embeddings once, before "
      "any layer, so they cannot differ between layers; pattern kinds must act inside "
      f"attention: {tuple(k for k, c in POSENCS.items() if c.embed is PosEnc.embed)}"
    )
  rotary = [k for k in kinds if POSENCS[k].accepts_rope_scaling]
  for field, value in (
    ("posenc.max_wavelength_pattern", cfg.max_wavelength_pattern),
    ("posenc.scaling.kind", cfg.scaling.kind if cfg.scaling.kind != "none" else ""),
    ("posenc.rope_truncate", cfg.rope_truncate or ""),
    ("posenc.rope_resonance", cfg.rope_resonance or ""),
  ):
    if value and not rotary:
      raise ValueError(
        f"{field}={value!r} applies to rotary layers, and posenc.layer_pattern="
        f"{cfg.layer_pattern!r} has none (rotary kinds: "
        f"{tuple(k for k, c in POSENCS.items() if c.accepts_rope_scaling)})"
      )
  if cfg.randomize_max and not any(POSENCS[k].reads_positions for k in kinds):
    raise ValueError(
      f"posenc.randomize_max={cfg.randomize_max} randomizes positions that no layer of "
      f"posenc.layer_pattern={cfg.layer_pattern!r} reads; set it to 0"
    )
  for layer in set(layer_configs(cfg)):
    if not POSENCS[layer.kind].reads_positions:
      layer = dataclasses.replace(layer, randomize_max=0)
    validate_posenc(layer, causal=causal, head_dim=head_dim)


def make_posenc(
  cfg: PosEncConfig,
  *,
  num_heads: int,
  head_dim: int,
  emb_dim: int,
  causal: bool,
  num_kv_heads: int = 0,
  param_dtype=jnp.float32,
  embed_init_std: float = 0.02,
  rngs: nnx.Rngs,
) -> PosEnc:
  """The encoding `POSENCS[cfg.kind]` (one per model) of a validated `cfg` (a ModelConfig
  validates its posenc when it is built); with a per-layer pattern, a `LayerPattern` holding one
  encoding per distinct layer config (parameter-free for kinds whose layers build their own,
  `PosEnc.per_layer`). `num_kv_heads` (0 = num_heads) is the number of key heads `rotate`
  receives (PoPE's key phase bias has one row per key head)."""
  common = dict(
    num_heads=num_heads, head_dim=head_dim, emb_dim=emb_dim, causal=causal,
    num_kv_heads=num_kv_heads, param_dtype=param_dtype, embed_init_std=embed_init_std, rngs=rngs,
  )  # fmt: skip
  if has_pattern(cfg):
    configs = layer_configs(cfg)
    distinct = list(dict.fromkeys(configs))
    entries = [
      (PosEnc if POSENCS[c.kind].per_layer(c) else POSENCS[c.kind])(c, **common) for c in distinct
    ]
    return LayerPattern(cfg, entries, tuple(distinct.index(c) for c in configs), **common)
  return POSENCS[cfg.kind](cfg, **common)


__all__ = [
  "POSENCS",
  "Alibi",
  "Cope",
  "Fire",
  "Kerple",
  "LayerPattern",
  "QUERY_SCALES",
  "QueryScale",
  "Learned",
  "NoPE",
  "PosEnc",
  "Pope",
  "Rope",
  "Sandwich",
  "Sinusoidal",
  "UnknownEncodingError",
  "T5Bias",
  "XPos",
  "alibi_slopes",
  "apply_rotary",
  "encoding_fields",
  "fields_of",
  "layer_configs",
  "make_posenc",
  "param",
  "pope_features",
  "pope_frequencies",
  "register",
  "rope_frequencies",
  "rope_long_term_decay",
  "rope_sin_cos",
  "rotary_dims",
  "sinusoidal_embedding",
  "t5_relative_bucket",
  "unregister",
  "validate_posenc",
]
