"""What one perplexity evaluation asks for, as data: lengths, protocols, tokens, overrides.

eval.py (and the grids) turn their options into an `EvalSpec` with `spec_from_options`, the one
place where command-line shapes (a factor "auto" or a number, a protocol "both") are parsed; the
driver (ppl_vs_length.py) reads only the spec. The spec also names its result file
(`output_name`), so two evaluations that differ never share DIR/eval/NAME.json.
"""

import dataclasses
import re
from collections.abc import Sequence

from roformer.data import PROTOCOLS
from roformer.evals.effective_length import EffectiveRule
from roformer.evals.plots import DEFAULT_NAME
from roformer.posenc import randomized as randomized_positions
from roformer.posenc.config import EXTENSION_FIELDS, EXTENSION_KINDS, ContextExtension
from roformer.posenc.rope_scaling import SCALING_KINDS

DEFAULT_MAX_TOKENS = 65536  # eval.py --max_tokens
# Query temperatures without parameters, which evaluation can impose on any decoder run
# (posenc/query_scale.py): both are 1 for the n < L keys a query sees within the training length
# L, so they change what a run sees beyond it. logn: Qwen's log_L(n) for n > L; llama4:
# 1 + 0.1 ln(floor(n / L) + 1), floor_scale = L.
EVAL_QUERY_SCALES = ("logn", "llama4")
AUTO_FACTOR = "auto"


def default_lengths(seq_len: int) -> list[int]:
  """The training length to 16x by powers of two."""
  return [seq_len * 2**i for i in range(5)]


def parse_rope_factor(value: str | float) -> float | str:
  """--rope_factor: a number >= 1, or "auto" (target length / training length at each length)."""
  if isinstance(value, str) and value.strip() == AUTO_FACTOR:
    return AUTO_FACTOR
  try:
    factor = float(value)
  except ValueError:
    raise ValueError(f"--rope_factor must be a number or 'auto', got {value!r}") from None
  if not factor > 0:
    raise ValueError(f"--rope_factor must be > 0, got {value!r}")
  return factor


def factor_at(rope_factor: float | str, length: int, seq_len: int) -> float:
  """The scaling factor at `length`: the given one, or for "auto" s = length / training length
  (at least 1), as Position Interpolation and YaRN set s for a target context."""
  if rope_factor == AUTO_FACTOR:
    return max(1.0, length / seq_len)
  return float(rope_factor)


# Where YaRN's and NTK-by-parts' beta_fast / beta_slow count rotations: over the training length
# (Hugging Face, the YaRN paper) or over each evaluated length (Resonance RoPE's from-scratch
# code: its YaRN gets the extended length as max_position_embeddings).
ROPE_RAMPS = ("trained", "evaluated")
RAMPED_SCALINGS = ("ntk_by_parts", "yarn")


def _ramp_given(beta_fast: float, beta_slow: float, ramp: str) -> bool:
  return bool(beta_fast or beta_slow or ramp != "trained")


@dataclasses.dataclass(frozen=True)
class RopeOverride:
  """A RoPE scaling applied at evaluation: a SCALING_KINDS kind and its factor, a number or
  AUTO_FACTOR (the evaluated length over the training length, at each length); for
  RAMPED_SCALINGS also beta_fast and beta_slow (0 = posenc.scaling's defaults) and the length
  their rotations are counted over (ROPE_RAMPS)."""

  kind: str
  factor: float | str = 1.0
  beta_fast: float = 0.0
  beta_slow: float = 0.0
  ramp: str = "trained"

  def __post_init__(self):
    if self.kind not in SCALING_KINDS or self.kind == "none":
      raise ValueError(f"--rope_scaling must be one of {SCALING_KINDS}, got {self.kind!r}")
    object.__setattr__(self, "factor", parse_rope_factor(self.factor))
    if self.ramp not in ROPE_RAMPS:
      raise ValueError(f"--rope_ramp must be one of {ROPE_RAMPS}, got {self.ramp!r}")
    for name in ("beta_fast", "beta_slow"):
      if getattr(self, name) < 0:
        raise ValueError(
          f"--rope_{name} must be > 0 (0: posenc.scaling's default), got {getattr(self, name)}"
        )
    if self.kind not in RAMPED_SCALINGS and self.ramped():
      raise ValueError(
        f"--rope_beta_fast, --rope_beta_slow and --rope_ramp are read by --rope_scaling in "
        f"{RAMPED_SCALINGS}, not by --rope_scaling={self.kind}"
      )

  def ramped(self) -> bool:
    """Whether the ramp differs from posenc.scaling's defaults."""
    return _ramp_given(self.beta_fast, self.beta_slow, self.ramp)

  def scaling_fields(self, length: int) -> dict:
    """posenc.scaling fields beyond kind and factor for windows of `length` tokens."""
    fields = {n: getattr(self, n) for n in ("beta_fast", "beta_slow") if getattr(self, n)}
    if self.ramp == "evaluated":
      fields["ramp_len"] = length
    return fields


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """One evaluation of a run's checkpoint.

  Attributes:
    lengths: window lengths, sorted; () = the training length to 16x (`default_lengths`).
    protocol: "nonoverlapping", "sliding" or "both".
    stride: sliding stride; 0 = length // 4.
    max_tokens: scored tokens per length (rounded down to whole windows of the longest length).
    split: "validation" or "test" of the run's corpus.
    data_files: a glob of other text, tokenized with the run's tokenizer (replaces `split`).
    batch_size: windows per batch; 0 = about AUTO_BATCH_TOKENS tokens per batch.
    rope: a RoPE scaling applied at evaluation; None = as trained.
    window: a sliding attention window imposed at evaluation (0 = as trained).
    bca: xPos's blockwise causal attention with blocks of `window`, or of the training length
      when `window` is 0.
    extension: a training-free context extension applied at evaluation (Self-Extend, DCA,
      ReRoPE, STRING, attention sinks); None = none.
    query_scale: a parameter-free query temperature applied at evaluation ("logn" or "llama4",
      `EVAL_QUERY_SCALES`); "none" = as trained.
    position_draws: draws of positions at which a run trained with randomized positions is
      scored (the loss is their mean).
    effective: the limit of the effective length recorded with the result (each protocol's
      longest length whose loss stays within -ln(fraction) nats of the training length's, or
      whose perplexity stays under an absolute threshold; effective_length.py).
    key_tokens: add each non-overlapping record's key-token perplexity (LongPPL, key_tokens.py).
    key_short_window: K of the key tokens' short pass; 0 = a quarter of the training length
      (`key_window_for`).
    out: NAME of DIR/eval/NAME.json; "" = `output_name`.
  """

  lengths: tuple[int, ...] = ()
  protocol: str = "both"
  stride: int = 0
  max_tokens: int = DEFAULT_MAX_TOKENS
  split: str = "validation"
  data_files: str = ""
  batch_size: int = 0
  rope: RopeOverride | None = None
  window: int = 0
  bca: bool = False
  extension: ContextExtension | None = None
  query_scale: str = "none"
  position_draws: int = randomized_positions.EVAL_DRAWS
  effective: EffectiveRule = EffectiveRule()
  key_tokens: bool = False
  key_short_window: int = 0
  out: str = ""

  def __post_init__(self):
    if self.protocol not in (*PROTOCOLS, "both"):
      raise ValueError(f"--protocol must be one of {PROTOCOLS + ('both',)}, got {self.protocol!r}")
    lengths = tuple(sorted({int(x) for x in self.lengths}))
    if lengths and lengths[0] < 1:
      raise ValueError(f"--lengths must be positive, got {list(lengths)}")
    object.__setattr__(self, "lengths", lengths)
    if self.max_tokens < 1:
      raise ValueError(f"--max_tokens must be >= 1, got {self.max_tokens}")
    if self.window < 0:
      raise ValueError(f"--window must be > 0, got {self.window}")
    if self.key_short_window < 0:
      raise ValueError(f"--key_short_window must be >= 0, got {self.key_short_window}")
    if self.key_short_window and not self.key_tokens:
      raise ValueError(f"--key_short_window={self.key_short_window} needs --key_tokens")
    if self.key_tokens and self.protocol == "sliding":
      raise ValueError(
        "--key_tokens scores the non-overlapping windows; use --protocol=nonoverlapping or both"
      )
    if self.query_scale not in ("none", *EVAL_QUERY_SCALES):
      raise ValueError(
        f"--query_scale must be one of {('none', *EVAL_QUERY_SCALES)}, got {self.query_scale!r} "
        "(ssmax learns its scale in training; a run trained with it keeps it)"
      )

  @property
  def protocols(self) -> tuple[str, ...]:
    return PROTOCOLS if self.protocol == "both" else (self.protocol,)

  @property
  def window_kind(self) -> str:
    return "blockwise" if self.bca else "sliding"

  def lengths_for(self, seq_len: int) -> list[int]:
    """The evaluated lengths of a run trained at `seq_len`."""
    return list(self.lengths) or default_lengths(seq_len)

  def window_for(self, seq_len: int) -> int:
    """The imposed attention window: BCA blocks default to the training length."""
    return self.window or (seq_len if self.bca else 0)

  def key_window_for(self, seq_len: int) -> int:
    """K of the key tokens' short pass (0 without --key_tokens): a quarter of the training
    length by default, so that every length from the training length up has candidates."""
    if not self.key_tokens:
      return 0
    return self.key_short_window or max(1, seq_len // 4)


def extension_from_options(kind: str = "none", **fields: int) -> ContextExtension | None:
  """--extend=KIND and its --extend_* numbers as a ContextExtension (None for "none"); a
  number the kind does not read is an error, never ignored."""
  if kind not in EXTENSION_KINDS:
    raise ValueError(f"--extend must be one of {EXTENSION_KINDS}, got {kind!r}")
  given = {name: value for name, value in fields.items() if value}
  if kind == "none":
    if given:
      raise ValueError(f"--extend_{next(iter(given))} needs --extend=KIND")
    return None
  unread = sorted(set(given) - set(EXTENSION_FIELDS[kind]))
  if unread:
    raise ValueError(
      f"--extend_{unread[0]} is not read by --extend={kind} (it reads "
      f"{', '.join('--extend_' + f for f in EXTENSION_FIELDS[kind])})"
    )
  try:
    return ContextExtension(kind=kind, **given)
  except ValueError as e:  # name the flags, not the config fields
    raise ValueError(_as_extend_flags(str(e), kind)) from None


def _as_extend_flags(message: str, kind: str) -> str:
  """A ContextExtension error in eval.py's words: posenc.extension.kind is --extend, the other
  fields are --extend_<field>; the config's pointer to the flag (" (eval.py --extend_x)") goes."""
  message = re.sub(r" \(eval\.py --extend_\w+\)", "", message)
  message = message.replace(f"posenc.extension.kind={kind!r}", f"--extend={kind}")
  return message.replace("posenc.extension.", "--extend_")


def spec_from_options(
  *,
  lengths: Sequence[int] = (),
  rope_scaling: str = "none",
  rope_factor: float | str = 1.0,
  rope_beta_fast: float = 0.0,
  rope_beta_slow: float = 0.0,
  rope_ramp: str = "trained",
  attention_window: int = 0,
  extend: str = "none",
  extend_fields: dict | None = None,
  **fields,
) -> EvalSpec:
  """An EvalSpec from eval.py's options (and the grids' recorded ones): `rope_scaling` "none"
  means no override, `attention_window` is the spec's `window`, and `extend` with
  `extend_fields` ({"window": W, ...}, 0 = not given) its `extension`."""
  ramp = dict(beta_fast=rope_beta_fast, beta_slow=rope_beta_slow, ramp=rope_ramp)
  rope = None if rope_scaling == "none" else RopeOverride(rope_scaling, rope_factor, **ramp)
  if rope is None:
    parse_rope_factor(rope_factor)  # a bad --rope_factor is an error even without a scaling
    if _ramp_given(rope_beta_fast, rope_beta_slow, rope_ramp):
      raise ValueError("--rope_beta_fast, --rope_beta_slow and --rope_ramp need --rope_scaling")
  extension = extension_from_options(extend, **(extend_fields or {}))
  return EvalSpec(
    lengths=tuple(lengths), rope=rope, window=attention_window, extension=extension, **fields
  )


def extension_suffix(extension: ContextExtension) -> str:
  """`_<kind>` and the numbers it reads, e.g. `_self_extend_window512_group8` (train_len only
  where given: 0 is the run's training length)."""
  numbers = "".join(
    f"_{f}{getattr(extension, f)}"
    for f in EXTENSION_FIELDS[extension.kind]
    if f != "train_len" or extension.train_len
  )
  return f"_{extension.kind}{numbers}"


def rope_options(rope: "RopeOverride | None", length: int, seq_len: int) -> dict:
  """`runs.eval_model_config`'s rope_scaling and rope_factor for windows of `length` tokens:
  the override's kind and its factor there ("auto": length / seq_len), or none."""
  if rope is None:
    return {"rope_scaling": "none", "rope_factor": 1.0}
  return {
    "rope_scaling": rope.kind,
    "rope_factor": factor_at(rope.factor, length, seq_len),
    "rope_fields": rope.scaling_fields(length),
  }


def overrides_suffix(
  *,
  rope: RopeOverride | None = None,
  window: int = 0,
  window_name: str = "window",
  extension: ContextExtension | None = None,
  query_scale: str = "none",
) -> str:
  """The name suffix of the model overrides an evaluation applies: a RoPE scaling
  (`_<scaling>_<factor>`, factor "auto" too; `_bf<N>`, `_bs<N>`, `_ramp_evaluated` for its
  ramp), an attention window (`_window<W>`, `_bca<W>`), a
  context extension (`_<kind>_<field><N>...`) and a query temperature (`_qscale_<kind>`); "" for
  none."""
  suffix = ""
  if rope is not None:
    factor = rope.factor
    suffix += f"_{rope.kind}_{factor if factor == AUTO_FACTOR else f'{float(factor):g}'}"
    if rope.beta_fast:
      suffix += f"_bf{rope.beta_fast:g}"
    if rope.beta_slow:
      suffix += f"_bs{rope.beta_slow:g}"
    if rope.ramp != "trained":
      suffix += f"_ramp_{rope.ramp}"
  if window:
    suffix += f"_{window_name}{window}"
  if extension is not None:
    suffix += extension_suffix(extension)
  if query_scale != "none":
    suffix += f"_qscale_{query_scale}"
  return suffix


def output_name(spec: EvalSpec, *, seq_len: int) -> str:
  """NAME of DIR/eval/NAME.json: `spec.out`, else ppl_vs_length with a suffix per non-default
  choice.

  Evaluating other text (`_files`), the test split (`_test`), other lengths (`_len256-512`), one
  protocol (`_sliding`), a stride (`_stride64`), another number of scored tokens (`_tok8192`), a
  RoPE scaling (`_<scaling>_<factor>`, factor "auto" too, then `_bf<beta_fast>`, `_bs<beta_slow>`
  and `_ramp_evaluated` where set), an attention window (`_window<W>`,
  `_bca<W>`), a context extension (`_<kind>_<field><N>...`) or key tokens (`_keytok<K>`) never
  overwrites the plain validation result.
  """
  if spec.out:
    return spec.out
  name = DEFAULT_NAME
  if spec.data_files:
    name += "_files"
  elif spec.split != "validation":
    name += f"_{spec.split}"
  if spec.lengths and list(spec.lengths) != default_lengths(seq_len):
    name += "_len" + "-".join(str(x) for x in spec.lengths)
  if spec.protocol != "both":
    name += f"_{spec.protocol}"
  if spec.stride and spec.protocol != "nonoverlapping":
    name += f"_stride{spec.stride}"
  if spec.max_tokens != DEFAULT_MAX_TOKENS:
    name += f"_tok{spec.max_tokens}"
  name += overrides_suffix(
    rope=spec.rope,
    window=spec.window_for(seq_len),
    window_name="bca" if spec.bca else "window",
    extension=spec.extension,
    query_scale=spec.query_scale,
  )
  if spec.key_tokens:
    name += f"_keytok{spec.key_window_for(seq_len)}"
  return name
