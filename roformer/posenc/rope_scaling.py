"""RoPE inverse frequencies and their context-extension scalings, as pure functions.

linear, dynamic, yarn and llama3 match Hugging Face transformers' `modeling_rope_utils` (checked
against tests/fixtures/rope_hf.json), and so does longrope (tests/posenc/longrope_test.py);
`ntk` is the static NTK-aware base change and `ntk_by_parts` is YaRN's interpolation without
its attention factor.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from roformer.posenc.config import RopeScaling

_DEFAULTS = dataclasses.asdict(RopeScaling())


def scaling_fields(scaling: RopeScaling | Mapping[str, Any] | None) -> dict[str, Any] | None:
  """Normalises a scaling (dataclass, partial mapping or None) to a full dict, or None for none."""
  if scaling is None:
    return None
  if isinstance(scaling, RopeScaling):
    scaling = dataclasses.asdict(scaling)
  unknown = set(scaling) - set(_DEFAULTS)
  if unknown:
    raise ValueError(
      f"unknown posenc.scaling field(s) {sorted(unknown)}; allowed: {sorted(_DEFAULTS)}"
    )
  fields = {**_DEFAULTS, **scaling}
  return None if fields["kind"] == "none" else fields


def check_scaling(
  scaling: RopeScaling | Mapping[str, Any] | None, *, need_original_len: bool = True
) -> None:
  """Raises ValueError naming the posenc.scaling field that is out of range.

  Args:
    scaling: the scaling config.
    need_original_len: whether an unset `original_max_len` (0) is an error. The config boundary
      fills it with the training length, so validation before that point passes False.
  """
  s = scaling_fields(scaling)
  if s is None:
    return
  if s["kind"] not in SCALINGS:
    raise ValueError(f"posenc.scaling.kind={s['kind']!r} is not one of {SCALING_KINDS}")
  if not s["factor"] >= 1.0:
    raise ValueError(
      f"posenc.scaling.factor={s['factor']} must be >= 1 for posenc.scaling.kind="
      f"{s['kind']!r} (it is the context-extension ratio; use kind 'none' for no scaling)"
    )
  if s["original_max_len"] < 0:
    raise ValueError(f"posenc.scaling.original_max_len={s['original_max_len']} must be >= 0")
  if need_original_len and SCALINGS[s["kind"]].needs_original_len and s["original_max_len"] <= 0:
    raise ValueError(
      f"posenc.scaling.original_max_len must be > 0 (the pretraining length) for "
      f"posenc.scaling.kind={s['kind']!r}; 0 means 'the training length' and is filled in by "
      "the config loader"
    )
  if s["kind"] in ("ntk_by_parts", "yarn") and not (s["beta_fast"] > 0 and s["beta_slow"] > 0):
    raise ValueError(
      f"posenc.scaling.beta_fast={s['beta_fast']} and posenc.scaling.beta_slow={s['beta_slow']} "
      "must both be > 0"
    )
  if s["ramp_len"] < 0:
    raise ValueError(f"posenc.scaling.ramp_len={s['ramp_len']} must be >= 0")
  if s["ramp_len"] and s["kind"] not in ("ntk_by_parts", "yarn"):
    raise ValueError(
      f"posenc.scaling.ramp_len={s['ramp_len']} is read by posenc.scaling.kind 'ntk_by_parts' and "
      f"'yarn', not by {s['kind']!r}"
    )
  if s["kind"] == "yarn" and (s["mscale"] < 0 or s["mscale_all_dim"] < 0):
    raise ValueError("posenc.scaling.mscale and posenc.scaling.mscale_all_dim must be >= 0")
  if s["kind"] == "longrope":
    short, long = s["short_factor"], s["long_factor"]
    if not short or len(short) != len(long):
      raise ValueError(
        "posenc.scaling.kind='longrope' needs posenc.scaling.short_factor and long_factor, "
        f"lists of head_dim / 2 numbers each; got {len(short)} and {len(long)}"
      )
    if min(*short, *long) <= 0 or s["attention_factor"] < 0:
      raise ValueError(
        "posenc.scaling.short_factor and long_factor must be > 0 and attention_factor >= 0"
      )
  if s["kind"] == "llama3" and not 0 < s["low_freq_factor"] < s["high_freq_factor"]:
    raise ValueError(
      f"posenc.scaling.low_freq_factor={s['low_freq_factor']} and posenc.scaling."
      f"high_freq_factor={s['high_freq_factor']} must satisfy 0 < low_freq_factor < "
      "high_freq_factor"
    )


def rope_frequencies(
  head_dim: int,
  max_wavelength: float = 10000.0,
  scaling: RopeScaling | Mapping[str, Any] | None = None,
  seq_len: int | jax.Array | None = None,
) -> tuple[jax.Array, float]:
  """Inverse frequencies theta_i = b^(-2i/d) of RoPE, optionally rescaled for longer contexts.

  Args:
    head_dim: d, the number of rotary dimensions (even; the rotated part of a head).
    max_wavelength: the base b.
    scaling: None, a `RopeScaling`, or a mapping with "kind" in SCALING_KINDS and any of its
      fields (missing ones take the `RopeScaling` defaults):
      - linear: theta_i / factor (position interpolation).
      - ntk: static NTK-aware base b * factor^(d / (d - 2)).
      - dynamic: HF's dynamic NTK, b * (factor * L / L0 - (factor - 1))^(d / (d - 2)) with
        L = max(seq_len, L0) and L0 = original_max_len; equals the plain frequencies up to L0.
      - ntk_by_parts: YaRN's per-frequency interpolation between theta_i / factor (long
        wavelengths) and theta_i (short), ramped between beta_slow and beta_fast rotations over
        L0, or over `ramp_len` where it is set; attention factor 1.
      - yarn: ntk_by_parts plus HF's attention factor: mscale(factor, mscale) /
        mscale(factor, mscale_all_dim) when both are set (non-zero), else mscale(factor, 1),
        with mscale(s, m) = 0.1 m ln(s) + 1 for s > 1 (1 otherwise). A lone `mscale` is
        ignored, as in HF.
      - llama3: Llama 3.1's piecewise scaling with factor, low_freq_factor, high_freq_factor
        and original_max_len.
      - longrope: LongRoPE (Ding et al. 2024) as HF's `longrope`: theta_i / long_factor[i] when
        seq_len > original_max_len, else theta_i / short_factor[i]; attention factor
        `attention_factor`, or sqrt(1 + ln(factor) / ln(original_max_len)) (1 for factor 1).
    seq_len: the current length (max position + 1), used by "dynamic" only. A Python int gives
      a constant; a jax array (e.g. traced inside jit) gives frequencies computed in float32.
      None means L0.

  Returns:
    (inv_freq float32 [d // 2], attention_factor). The attention factor multiplies cos and sin
    of both queries and keys, so the attention logits scale by its square.
  """
  if head_dim < 2 or head_dim % 2:
    raise ValueError(f"rope_frequencies needs an even number of rotary dims, got {head_dim}")
  if not max_wavelength > 1:
    raise ValueError(f"posenc.max_wavelength={max_wavelength} must be > 1")
  check_scaling(scaling)
  s = scaling_fields(scaling)
  d, base = head_dim, float(max_wavelength)
  exponent = np.arange(0, d, 2, dtype=np.float64) / d  # 2i / d
  inv_freq = base**-exponent
  if s is None:
    return _f32(inv_freq), 1.0
  if s["kind"] in ("ntk", "dynamic") and d <= 2:
    raise ValueError(f"posenc.scaling.kind={s['kind']!r} needs at least 4 rotary dims, got {d}")
  return SCALINGS[s["kind"]](inv_freq, d, base, s, seq_len)


def mla_softmax_factor(scaling: RopeScaling | Mapping[str, Any] | None) -> float:
  """DeepSeek-V2's multiplier of the softmax scale of multi-head latent attention under YaRN.

  DeepSeek multiplies d_qk^-0.5 by mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set
  (its sin/cos then carry mscale(factor, mscale) / mscale(factor, mscale_all_dim), the attention
  factor of `rope_frequencies`); 1 otherwise.
  """
  s = scaling_fields(scaling)
  if s is None or s["kind"] != "yarn" or not s["mscale_all_dim"]:
    return 1.0
  factor, m = float(s["factor"]), float(s["mscale_all_dim"])
  mscale = 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
  return mscale * mscale


def _f32(x: np.ndarray) -> jax.Array:
  return jnp.asarray(np.asarray(x, np.float32))


# ---- The scalings: fn(inv_freq float64 [d/2], d, base, fields, seq_len) -> (inv_freq, factor) ----


def _scaling(*, needs_original_len: bool):
  """Marks a scaling function with whether it reads the pretraining length L0."""

  def mark(fn):
    fn.needs_original_len = needs_original_len
    return fn

  return mark


@_scaling(needs_original_len=False)
def _linear(inv_freq, d, base, s, seq_len):
  return _f32(inv_freq / s["factor"]), 1.0


@_scaling(needs_original_len=False)
def _ntk(inv_freq, d, base, s, seq_len):
  exponent = np.arange(0, d, 2, dtype=np.float64) / d
  return _f32((base * float(s["factor"]) ** (d / (d - 2))) ** -exponent), 1.0


@_scaling(needs_original_len=True)
def _dynamic(inv_freq, d, base, s, seq_len):
  return _dynamic_ntk(inv_freq, d, float(s["factor"]), s["original_max_len"], seq_len), 1.0


@_scaling(needs_original_len=True)
def _ntk_by_parts(inv_freq, d, base, s, seq_len):
  return _f32(_yarn_inv_freq(inv_freq, d, base, s)), 1.0


@_scaling(needs_original_len=True)
def _yarn(inv_freq, d, base, s, seq_len):
  factor = float(s["factor"])
  attention_factor = _yarn_attention_factor(factor, s["mscale"], s["mscale_all_dim"])
  return _f32(_yarn_inv_freq(inv_freq, d, base, s)), attention_factor


@_scaling(needs_original_len=True)
def _llama3(inv_freq, d, base, s, seq_len):
  return _f32(_llama3_inv_freq(inv_freq, float(s["factor"]), s["original_max_len"], s)), 1.0


@_scaling(needs_original_len=True)
def _longrope(inv_freq, d, base, s, seq_len):
  short, long = np.asarray(s["short_factor"]), np.asarray(s["long_factor"])
  if len(short) != d // 2:
    raise ValueError(
      f"posenc.scaling.short_factor and long_factor have {len(short)} entries; the {d} rotary "
      f"dims need {d // 2}"
    )
  l0, factor = s["original_max_len"], float(s["factor"])
  attention_factor = float(s["attention_factor"]) or (
    1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(l0))
  )
  # HF divides theta_i by the factors in float32: 1 / (ext * b^(2i/d)).
  base_pow = np.float32(base) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
  short_inv = _f32(1.0 / (short.astype(np.float32) * base_pow))
  long_inv = _f32(1.0 / (long.astype(np.float32) * base_pow))
  if seq_len is None or isinstance(seq_len, int | np.integer):
    return (long_inv if seq_len is not None and seq_len > l0 else short_inv), attention_factor
  # A traced length (max position + 1 inside jit) picks the set as HF's dynamic update does.
  return jnp.where(jnp.asarray(seq_len) > l0, long_inv, short_inv), attention_factor


def _dynamic_ntk(inv_freq, d, factor, l0, seq_len):
  # b'^(-2i/d) = b^(-2i/d) * g^(-2i/(d-2)) with g = factor * L / L0 - (factor - 1): scaling the
  # exact base frequencies by a power of g (close to 1) keeps float32 error at a few ulp, where
  # raising a large b' to a float32 power would not.
  power = np.arange(0, d, 2, dtype=np.float64) / (d - 2)
  if seq_len is None or isinstance(seq_len, int | np.integer):
    length = max(int(seq_len if seq_len is not None else l0), l0)
    g = factor * length / l0 - (factor - 1)
    return _f32(inv_freq * g**-power)
  length = jnp.maximum(jnp.asarray(seq_len).astype(jnp.float32), jnp.float32(l0))
  g = jnp.float32(factor) * length / jnp.float32(l0) - jnp.float32(factor - 1)
  log_g = jnp.log(g)
  return _f32(inv_freq) * jnp.exp(-_f32(power) * log_g)


def _yarn_inv_freq(inv_freq, d, base, s):
  factor, beta_fast, beta_slow = float(s["factor"]), s["beta_fast"], s["beta_slow"]
  # Rotations are counted over the original length (HF, the YaRN paper), or over `ramp_len`
  # (Resonance RoPE's from-scratch code passes the extended length as max_position_embeddings).
  span = s["ramp_len"] or s["original_max_len"]

  def correction_dim(num_rotations):
    # The dimension whose wavelength makes `num_rotations` turns over the span.
    return d * math.log(span / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

  # truncate=True (HF's default): whole dims; `high` is clamped to d - 1 as in HF.
  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), d - 1)
  if low == high:
    high += 0.001  # avoids a zero-width ramp
  ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrapolation = 1.0 - ramp  # 1 keeps theta_i (high frequencies), 0 interpolates it
  return inv_freq / factor * (1.0 - extrapolation) + inv_freq * extrapolation


def _yarn_attention_factor(factor, mscale, mscale_all_dim):
  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if mscale and mscale_all_dim:
    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
  return float(get_mscale(factor))


def _llama3_inv_freq(inv_freq, factor, l0, s):
  low, high = s["low_freq_factor"], s["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths (> L0 / low) are interpolated, short ones (< L0 / high) kept, and the band
  # between is blended linearly in L0 / wavelength.
  scaled = np.where(wavelen > l0 / low, inv_freq / factor, inv_freq)
  smooth = (l0 / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < l0 / high) & ~(wavelen > l0 / low)
  return np.where(medium, smoothed, scaled)


# The registry: a new scaling is one function here and one entry.
SCALINGS = {
  "linear": _linear,
  "ntk": _ntk,
  "dynamic": _dynamic,
  "ntk_by_parts": _ntk_by_parts,
  "yarn": _yarn,
  "llama3": _llama3,
  "longrope": _longrope,
}
SCALING_KINDS = ("none", *SCALINGS)
