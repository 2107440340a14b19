"""Every positional encoding: pure math functions, small modules and one registry.

An encoding acts through up to three hooks of `PosEnc` (embed, rotate, bias); `POSENCS` maps
`posenc.kind` to its class and is the only switch on the kind.
"""

import jax.numpy as jnp
from flax import nnx

from roformer.posenc.absolute import Learned, Sinusoidal, sinusoidal_embedding
from roformer.posenc.base import NoPE, PosEnc
from roformer.posenc.config import ROPE_LAYOUTS, PosEncConfig
from roformer.posenc.cope import Cope
from roformer.posenc.fire import Fire
from roformer.posenc.kerple import Kerple
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

POSENCS: dict[str, type[PosEnc]] = {
  "rope": Rope,
  "sinusoidal": Sinusoidal,
  "learned": Learned,
  "alibi": Alibi,
  "t5": T5Bias,
  "xpos": XPos,
  "nope": NoPE,
  "kerple": Kerple,
  "fire": Fire,
  "sandwich": Sandwich,
  "cope": Cope,
}


def validate_posenc(
  cfg: PosEncConfig,
  *,
  causal: bool,
  head_dim: int,
  attention_impl: str = "auto",
) -> None:
  """Raises ValueError, naming the config field and its allowed values, for a bad posenc config.

  Args:
    cfg: the positional-encoding config.
    causal: True for a decoder, False for an encoder.
    head_dim: the model's per-head dim (model.head_dim after its default is resolved).
    attention_impl: the model's kernel (an encoding with a content bias needs dense or auto).
  """
  if cfg.kind not in POSENCS:
    raise ValueError(f"posenc.kind={cfg.kind!r} is not one of {tuple(POSENCS)}")
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
  if cfg.randomize_max < 0:
    raise ValueError(f"posenc.randomize_max={cfg.randomize_max} must be >= 0 (0 = off)")
  if cfg.randomize_max and not cls.reads_positions:
    raise ValueError(
      f"posenc.randomize_max={cfg.randomize_max} randomizes the token positions, which "
      f"posenc.kind={cfg.kind!r} never reads (training would be unchanged); set it to 0"
    )
  if cls.content_bias is not None and attention_impl == "chunked":
    raise ValueError(
      f"posenc.kind={cfg.kind!r} adds a content-dependent bias that only the dense kernel "
      "computes; set model.attention_impl to 'dense' or 'auto' (auto uses dense for it)"
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


def make_posenc(
  cfg: PosEncConfig,
  *,
  num_heads: int,
  head_dim: int,
  emb_dim: int,
  causal: bool,
  param_dtype=jnp.float32,
  embed_init_std: float = 0.02,
  rngs: nnx.Rngs,
) -> PosEnc:
  """The encoding `POSENCS[cfg.kind]` (one per model) of a validated `cfg` (a ModelConfig
  validates its posenc when it is built)."""
  return POSENCS[cfg.kind](
    cfg,
    num_heads=num_heads,
    head_dim=head_dim,
    emb_dim=emb_dim,
    causal=causal,
    param_dtype=param_dtype,
    embed_init_std=embed_init_std,
    rngs=rngs,
  )


__all__ = [
  "POSENCS",
  "Alibi",
  "Cope",
  "Fire",
  "Kerple",
  "Learned",
  "NoPE",
  "PosEnc",
  "Rope",
  "Sandwich",
  "Sinusoidal",
  "T5Bias",
  "XPos",
  "alibi_slopes",
  "apply_rotary",
  "make_posenc",
  "rope_frequencies",
  "rope_long_term_decay",
  "rope_sin_cos",
  "rotary_dims",
  "sinusoidal_embedding",
  "t5_relative_bucket",
  "validate_posenc",
]
