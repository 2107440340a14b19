"""Frozen configuration of the positional encodings (the library never sees a ConfigDict)."""

import dataclasses
from typing import Any

from roformer import fields as config_fields
from roformer.fields import field_doc


def param(default: Any, doc: str, *, reshapes: bool = False) -> Any:
  """A config field of an encoding (or of the posenc group): its default and one-line doc
  (`roformer.fields.param`, the declaration every config group uses).

  `reshapes`: changing it changes the trained parameters' shapes or structure (a table's size,
  an MLP's width, one module per layer or one shared), so a checkpoint of the other value does
  not load. The posenc config group, `configs/default.py`'s defaults, `python -m roformer.posenc`
  and the resume rule are all read from these declarations.
  """
  return config_fields.param(default, doc, reshapes=reshapes)


# Fields several encodings declare (a shared name must be one field: `declare_fields`).
def max_wavelength_field() -> Any:
  return param(
    10000.0, "base b of the frequencies: RoPE / xPos / sinusoidal b^(-2i/d), pope b^(-c/d)"
  )


def max_len_field() -> Any:
  return param(
    512,
    "size of the learned position table (learned: the longest sequence the model can take; "
    "cope: max_len + 1 embeddings when cope_npos_max is 0)",
    reshapes=True,
  )


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

  kind: str = param(
    "none", "one of: none, linear, ntk, dynamic, ntk_by_parts, yarn, llama3, longrope"
  )
  factor: float = param(1.0, "context extension factor s")
  original_max_len: int = param(
    0,
    "pretrained context length L0: 0 = the data.seq_len of the train.init_from run when there is "
    "one (fine-tuning a shorter run) or the max_position_embeddings of the Hugging Face decoder "
    "it names, else this run's data.seq_len",
  )
  beta_fast: float = param(
    32.0, "ntk_by_parts / yarn: rotations per context above which a frequency is left alone"
  )
  beta_slow: float = param(
    1.0, "ntk_by_parts / yarn: rotations per context below which a frequency is fully interpolated"
  )
  ramp_len: int = param(
    0,
    "ntk_by_parts / yarn: the context over which beta_fast and beta_slow count rotations (0 = "
    "original_max_len, as Hugging Face and the YaRN paper; Resonance RoPE's from-scratch code "
    "counts them over the extended length: eval.py --rope_ramp=evaluated)",
  )
  mscale: float = param(0.0, "yarn: attention-factor coefficient (0 = use 0.1 ln(factor) + 1)")
  mscale_all_dim: float = param(
    0.0, "yarn: attention-factor coefficient of the denominator (0 = unused)"
  )
  low_freq_factor: float = param(
    1.0, "llama3: wavelengths longer than L0 / low_freq_factor are fully interpolated"
  )
  high_freq_factor: float = param(
    4.0, "llama3: wavelengths shorter than L0 / high_freq_factor are left alone"
  )
  short_factor: tuple[float, ...] = param(
    (),
    "longrope: per-dimension divisors of the frequencies (head_dim / 2 numbers) for lengths up "
    "to original_max_len, as Hugging Face's short_factor",
  )
  long_factor: tuple[float, ...] = param(
    (), "longrope: the divisors for lengths beyond original_max_len (Hugging Face's long_factor)"
  )
  attention_factor: float = param(
    0.0, "longrope: multiplier of sin and cos (0 = sqrt(1 + ln(factor) / ln(original_max_len)))"
  )

  def __post_init__(self):
    # Lists (config.json) become tuples of floats: the config stays hashable.
    for name in ("short_factor", "long_factor"):
      object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

  def as_mapping(self) -> dict | None:
    """The mapping `rope_frequencies(scaling=...)` takes, or None for kind "none"."""
    return None if self.kind == "none" else dataclasses.asdict(self)


# Training-free context extensions (roformer/posenc/extension.py); "none" leaves positions alone.
# Each method's plain name runs it as its reference code does by default; the suffixed kind is
# the variant the paper ran or the code's other path.
EXTENSION_KINDS = (
  "none", "self_extend", "self_extend_floor", "dca", "dca_paper", "rerope", "rerope_clamp",
  "string", "sinks",
)  # fmt: skip


# The ContextExtension fields each kind reads.
EXTENSION_FIELDS = {
  "self_extend": ("window", "group"),
  "self_extend_floor": ("window", "group"),
  "dca": ("chunk", "local", "train_len"),
  "dca_paper": ("chunk", "local"),
  "rerope": ("window", "train_len"),
  "rerope_clamp": ("window",),
  "string": ("shift", "local"),
  "sinks": ("sinks", "window"),
}
# Read fields that may stay 0: DCA's local window, STRING's local value, the number of sinks,
# and the training length of dca's and rerope's query factor (0 = the run's, set at evaluation).
_MAY_BE_ZERO = ("local", "sinks", "train_len")


@dataclasses.dataclass(frozen=True)
class ContextExtension:
  """A training-free context extension: the relative position (or the mask) of each
  (query, key) pair is remapped at evaluation (`roformer.posenc.extension`).

  Which fields a kind reads (each must then be set; 0 means "not set"):
    self_extend, self_extend_floor: window (neighbour window W), group (group size G).
    dca, dca_paper: chunk (chunk length s), local (local window w); dca also train_len.
    rerope, rerope_clamp: window (the clamp w); rerope also train_len.
    string: shift (shifted offset S), local (local value W < S).
    sinks: sinks (first tokens kept), window (recent keys, the query included).
  """

  kind: str = param(
    "none",
    "one of: none, self_extend, self_extend_floor, dca, dca_paper, rerope, rerope_clamp, string, "
    "sinks",
  )
  window: int = param(
    0,
    "self_extend(_floor): neighbour window W; rerope(_clamp): clamp w; sinks: recent keys (the "
    "query included)",
  )
  group: int = param(
    0, "self_extend(_floor): group size G (positions beyond the window are floor(pos / G))"
  )
  chunk: int = param(0, "dca(_paper): chunk length s (intra-chunk positions are pos mod s)")
  local: int = param(
    0, "dca(_paper): local window w; string: local value W (shifted distances restart at W)"
  )
  shift: int = param(0, "string: shifted offset S (distances >= S become d - S + W)")
  sinks: int = param(
    0, "sinks: the first tokens every query keeps (StreamingLLM's attention sinks)"
  )
  train_len: int = param(
    0,
    "dca, rerope: the training length L of their query factor (dca: (0.05 ln(n/L) + 1)^2 for a "
    "sequence of n > L; rerope: max(1, ln(pos + 1) / ln L)); 0 = the run's data.seq_len",
  )

  def __post_init__(self):
    if self.kind not in EXTENSION_KINDS:
      raise ValueError(f"posenc.extension.kind={self.kind!r} is not one of {EXTENSION_KINDS}")
    for name in ("window", "group", "chunk", "local", "shift", "sinks", "train_len"):
      if getattr(self, name) < 0:
        raise ValueError(f"posenc.extension.{name}={getattr(self, name)} must be >= 0")
    needs = [f for f in EXTENSION_FIELDS.get(self.kind, ()) if f not in _MAY_BE_ZERO]
    for name in needs:
      if getattr(self, name) < 1:
        raise ValueError(
          f"posenc.extension.kind={self.kind!r} needs posenc.extension.{name} >= 1 "
          f"(eval.py --extend_{name})"
        )
    if self.train_len == 1:
      raise ValueError(
        "posenc.extension.train_len=1: the training length of the query factor must be >= 2 "
        "(its log is a divisor), or 0 for the run's"
      )
    if self.kind == "string" and self.local >= self.shift:
      raise ValueError(
        f"posenc.extension.local={self.local} must be below posenc.extension.shift="
        f"{self.shift} for kind 'string' (shifted distances d - shift + local must shrink)"
      )


# The fields of the posenc group that belong to no single encoding (the encodings' own fields
# are declared by each PosEnc subclass in its `Fields` and registered with it).
@dataclasses.dataclass(frozen=True, init=False)
class PosEncConfig:
  """The positional-encoding config: the cross-cutting fields below, plus every registered
  encoding's own fields (`PosEnc.Fields`), read as attributes (`cfg.t5_num_buckets`).

  Built as `PosEncConfig(kind="t5", t5_num_buckets=16)`; an unknown field is a TypeError. Only the
  encoding fields that differ from their defaults are stored (`own`), so two configs that mean
  the same run are equal and hash alike whatever encodings were registered in between.
  """

  kind: str = param("rope", "the encoding: one of the registered kinds (python -m roformer.posenc)")
  # RoPE context-extension scaling (also overridable at evaluation time).
  scaling: RopeScaling = RopeScaling()
  # Training-free context extension of rotary decoders (eval.py --extend=KIND sets it).
  extension: ContextExtension = ContextExtension()
  randomize_max: int = param(
    0,
    "randomized positions (Ruoss et al. 2023), any kind that reads positions: each sequence (each "
    "packed document) takes a sorted random subset of [0, randomize_max) of its own length, in "
    "training and at evaluation (eval.py averages over --position_draws draws). 0 = off; else "
    ">= data.seq_len (and <= posenc.max_len for learned)",
  )
  layer_pattern: str = param(
    "",
    "per-layer encodings: kinds 'k1,k2,...' repeated over the layers ('' = every layer uses "
    "posenc.kind, which must otherwise be one of them), e.g. Llama 4's iRoPE "
    "'rope,rope,rope,nope'; kinds that act inside attention only",
  )
  max_wavelength_pattern: str = param(
    "",
    "per-layer RoPE bases 'b1,b2,...' repeated over the layers ('' = max_wavelength everywhere), "
    "e.g. Gemma 3's '10000,10000,10000,10000,10000,1000000'",
  )
  query_scale: str = param(
    "none",
    "query temperature, queries times t(n), n = position + 1 (decoders): none; logn (Qwen: "
    "log_L0(n) for n > L0); ssmax (Scalable-Softmax: s log n, s learned per head and layer); "
    "llama4 (1 + beta log(floor(n / floor) + 1)). Softmax attention only",
  )
  query_scale_len: int = param(
    0, "logn: the training length L0 (0 = data.seq_len, or that of the train.init_from run)"
  )
  query_scale_beta: float = param(0.1, "llama4: beta (Llama 4's attn_scale)")
  query_scale_floor: float = param(8192.0, "llama4: floor_scale")
  query_scale_kinds: str = param(
    "",
    "kinds of posenc.layer_pattern whose layers scale their queries ('' = every layer; Llama 4: "
    "'nope')",
  )
  # The registered encodings' fields that differ from their defaults, as sorted (name, value).
  own: tuple[tuple[str, Any], ...] = ()

  def __init__(self, **values: Any):
    declared = encoding_fields()
    own = dict(values.pop("own", ()))
    for f in dataclasses.fields(self):
      if f.name != "own":
        object.__setattr__(self, f.name, values.pop(f.name, f.default))
    for name, value in values.items():
      if name not in declared:
        raise TypeError(
          f"posenc has no field {name!r}: it is neither a field of the posenc group nor of a "
          f"registered encoding ({', '.join(sorted(declared))})"
        )
      own[name] = value
    own = {n: v for n, v in own.items() if n not in declared or v != declared[n].default}
    object.__setattr__(self, "own", tuple(sorted(own.items())))

  def __getattr__(self, name: str) -> Any:
    # Only reached for names that are not dataclass fields: a registered encoding's own field.
    if name.startswith("_"):
      raise AttributeError(name)
    for key, value in self.own:
      if key == name:
        return value
    declared = encoding_fields()
    if name in declared:
      return declared[name].default
    raise AttributeError(f"posenc has no field {name!r}")

  def __repr__(self) -> str:
    core = ", ".join(
      f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "own"
    )
    own = "".join(f", {n}={v!r}" for n, v in self.own)
    return f"PosEncConfig({core}{own})"

  def items(self) -> list[tuple[str, Any]]:
    """(name, value) of every field: the group's own, then every registered encoding's."""
    core = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "own"]
    return core + [(name, getattr(self, name)) for name in encoding_fields()]

  def to_dict(self) -> dict:
    """Every field as plain JSON-able values (the posenc group of config.json)."""
    return {
      name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
      for name, value in self.items()
    }


# ---- The registered encodings' fields (roformer/posenc/registry.py declares them) ----

# kind -> the fields its `PosEnc.Fields` declares, in registration order.
_DECLARED: dict[str, dict[str, dataclasses.Field]] = {}


def declare_fields(kind: str, fields_cls: type, owner: str) -> None:
  """Adds encoding `kind`'s fields (a dataclass, `PosEnc.Fields`) to the posenc group (None:
  removes them).

  Raises:
    ValueError: a field without a doc, a name of the group's own, or a name another kind
      declares with another type or default (a shared name must mean the same field, as
      max_wavelength does for RoPE, sinusoidal and PoPE).
  """
  if fields_cls is None:  # unregistered
    _DECLARED.pop(kind, None)
    return
  if not dataclasses.is_dataclass(fields_cls):
    raise ValueError(f"{owner}.Fields must be a dataclass of the encoding's fields")
  fields = {f.name: f for f in dataclasses.fields(fields_cls)}
  core = {f.name for f in dataclasses.fields(PosEncConfig)}
  others = encoding_fields(exclude=kind)
  for name, f in fields.items():
    if name in core:
      raise ValueError(f"{owner}.Fields.{name} is a field of the posenc group itself")
    if not field_doc(f):
      raise ValueError(
        f"{owner}.Fields.{name} has no doc: declare it with roformer.posenc.param(default, doc)"
      )
    if name in others and (others[name].type, others[name].default) != (f.type, f.default):
      raise ValueError(
        f"{owner}.Fields.{name} ({f.type}, default {f.default!r}) clashes with the field of "
        f"that name another encoding declares ({others[name].type}, default "
        f"{others[name].default!r}); rename it, e.g. {kind}_{name}"
      )
  _DECLARED[kind] = fields


def encoding_fields(*, exclude: str = "") -> dict[str, dataclasses.Field]:
  """Every registered encoding's fields by name (a shared name appears once)."""
  out: dict[str, dataclasses.Field] = {}
  for kind, fields in _DECLARED.items():
    if kind != exclude:
      for name, f in fields.items():
        out.setdefault(name, f)
  return out


def fields_of(kind: str) -> dict[str, dataclasses.Field]:
  """The fields encoding `kind` declares ({} for a kind nobody registered)."""
  return dict(_DECLARED.get(kind, {}))
