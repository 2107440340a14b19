"""The config boundary: a ConfigDict (or config.json) becomes frozen dataclasses, checked once.

Every bad value raises ConfigError naming the field and the allowed values, before any compiling.
"""

import codecs
import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from typing import Any

from etils import epath

from roformer.data import synthetic
from roformer.data.config import SOURCE_FIELDS, SOURCES, TOKENIZERS, DataConfig
from roformer.errors import ConfigError
from roformer.fields import param
from roformer.hf.decoders import DECODER_MODEL_TYPES
from roformer.infra.sharding import MESH_AXES, MeshConfig
from roformer.infra.workdir import CONFIG_FILE, read_config_json
from roformer.nn.attention.kernels import base as kernel_base
from roformer.nn.config import ModelConfig, unsupported_length
from roformer.posenc import registry
from roformer.posenc.config import ContextExtension, PosEncConfig, RopeScaling
from roformer.posenc.layers import pattern_kinds
from roformer.posenc.query_scale import resolve_query_scale_len

SCHEDULES = ("cosine", "linear", "constant")
# Fields a rerun in an existing workdir may change; any other difference is an error.
# config.json's list of the modules outside roformer that registered encodings (imported again
# before the rest is read).
IMPORTS_KEY = "imports"
RESUMABLE_FIELDS = (
  "train.num_train_steps",
  "train.log_every_steps",
  "train.eval_every_steps",
  "train.checkpoint_every_steps",
)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = param(3e-4, "Peak learning rate (reached at the end of warmup).")
  schedule: str = param("cosine", 'Decay after warmup: "cosine", "linear" or "constant".')
  warmup_steps: int = param(1000, "Steps of linear warmup from 0 to the peak learning rate.")
  final_learning_rate_fraction: float = param(
    0.1, "Learning rate at the last step, as a fraction of the peak (cosine and linear)."
  )
  weight_decay: float = param(
    0.1, "Decoupled weight decay; norms, biases and other 1-D parameters are never decayed."
  )
  b1: float = param(0.9, "Adam first-moment decay.")
  b2: float = param(0.95, "Adam second-moment decay.")
  eps: float = param(1e-8, "Adam epsilon.")
  grad_clip_norm: float = param(1.0, "Clip gradients to this global L2 norm (0 = no clipping).")
  grad_accum_steps: int = param(
    1, "Split each global batch into this many microbatches whose gradients are summed."
  )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  global_batch_size: int = param(
    64, "Sequences per optimizer step, over all devices and processes."
  )
  num_train_steps: int = param(
    100_000, "Total optimizer steps (a rerun may raise it to continue training)."
  )
  seed: int = param(0, "Seed of parameter initialisation, data order and dropout.")
  log_every_steps: int = param(100, "Write train metrics and a console line every this many steps.")
  eval_every_steps: int = param(
    2000, "Evaluate on the validation split every this many steps (0 = only at the end)."
  )
  eval_max_tokens: int = param(
    65_536, "Validation targets scored per evaluation (0 = no evaluation)."
  )
  eval_batch_size: int = param(0, "Windows per evaluation batch: 0 = train.global_batch_size.")
  checkpoint_every_steps: int = param(
    2000,
    "Save a checkpoint every this many steps (0 = only at the end); always saved at the end.",
  )
  keep_checkpoints: int = param(3, "Number of most recent checkpoints kept.")
  init_from: str = param(
    "",
    "Initialise parameters from another run's workdir (or its checkpoints/ directory), from a "
    "Hugging Face RoFormer directory, or from a Hugging Face decoder directory (whose "
    'config.json fixes model.* and posenc.*: configs/hf_decoder.py:DIR sets them); "" = random '
    "initialisation. Ignored when resuming.",
  )


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  data: DataConfig
  optim: OptimConfig
  train: TrainConfig
  mesh: MeshConfig


# ---- Building typed dataclasses from plain values ----


def _to_plain(config: Any) -> dict:
  """A ConfigDict or mapping as nested plain dicts."""
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise ConfigError(f"expected a config mapping, got {type(config).__name__}")
  return {
    k: _to_plain(v) if isinstance(v, Mapping) or hasattr(v, "to_dict") else v
    for k, v in config.items()
  }


def _coerce(value: Any, typ: Any, name: str) -> Any:
  """Checks `value` against a scalar field type (float accepts int); returns it typed."""
  if typ is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{name} must be a bool (True or False), got {value!r}")
    return value
  if typ is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value
  if typ is float:
    if isinstance(value, bool) or not isinstance(value, int | float):
      raise ConfigError(f"{name} must be a number, got {value!r}")
    # No float field reads inf or nan as a setting; either would surface only as a non-finite
    # loss (a learning rate of inf) or a silent NaN, after compiling.
    if not math.isfinite(value):
      raise ConfigError(f"{name} must be a finite number, got {value}")
    return float(value)
  if typ is str:
    if not isinstance(value, str):
      raise ConfigError(f"{name} must be a string, got {value!r}")
    return value
  return value


def _build(cls: type, values: Mapping, prefix: str, **nested: Any) -> Any:
  """Builds dataclass `cls` from `values`; unknown or mistyped fields are errors naming them."""
  if not isinstance(values, Mapping):
    raise ConfigError(f"{prefix} must be a group of fields, got {values!r}")
  hints = typing.get_type_hints(cls)
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(values) - set(known) - set(nested))
  if unknown:
    names = ", ".join(f"{prefix}.{k}" for k in unknown)
    raise ConfigError(
      f"unknown config field {names}; {prefix} has: "
      + ", ".join(k for k in known if k not in nested)
    )
  kwargs = {}
  for key, value in values.items():
    if key in nested:
      continue
    kwargs[key] = _coerce(value, hints[key], f"{prefix}.{key}")
  kwargs.update(nested)
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except ValueError as e:  # a config's own checks (a ModelConfig validates itself when built)
    raise ConfigError(str(e)) from e


def _build_posenc(values: Mapping, *, train_len: int) -> PosEncConfig:
  """The posenc group: its own fields and every registered encoding's (`PosEnc.Fields`), with
  the run-dependent defaults of the encodings the run's layers use resolved by those encodings
  (`PosEnc.resolve_defaults`) and scaling.original_max_len 0 by `train_len`."""
  if not isinstance(values, Mapping):
    raise ConfigError(f"posenc must be a group of fields, got {values!r}")
  values = dict(values)
  scaling = _build(RopeScaling, dict(values.pop("scaling", {})), "posenc.scaling")
  if scaling.original_max_len == 0:
    scaling = dataclasses.replace(scaling, original_max_len=train_len)
  extension = _build(ContextExtension, dict(values.pop("extension", {})), "posenc.extension")
  hints = typing.get_type_hints(PosEncConfig)
  types = {f.name: hints[f.name] for f in dataclasses.fields(PosEncConfig) if f.name != "own"}
  types.update({name: f.type for name, f in registry.encoding_fields().items()})
  unknown = sorted(set(values) - set(types))
  if unknown:
    names = ", ".join(f"posenc.{k}" for k in unknown)
    raise ConfigError(
      f"unknown config field {names}; posenc has: {', '.join(types)} (an encoding's own "
      "fields exist once the module that registers it is imported)"
    )
  typed = {k: _coerce(v, types[k], f"posenc.{k}") for k, v in values.items()}
  kinds = pattern_kinds(PosEncConfig(**typed, scaling=scaling, extension=extension))
  for kind in dict.fromkeys(kinds):
    if kind in registry.POSENCS:  # an unknown kind is reported when the model is checked
      typed = registry.POSENCS[kind].resolve_defaults(typed, train_len=train_len)
  typed = resolve_query_scale_len(typed, train_len=train_len)
  return PosEncConfig(**typed, scaling=scaling, extension=extension)


def _rules(value: Any) -> tuple:
  """Normalises mesh.rules (lists from JSON become tuples) and checks every entry."""
  allowed = f"a mesh axis name ({', '.join(MESH_AXES)}), a tuple of them, or None"
  if not isinstance(value, list | tuple):
    raise ConfigError(
      f"mesh.rules must be a tuple of (logical axis, mesh axes) pairs, got {value!r}"
    )
  rules = []
  for rule in value:
    if not (isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f"mesh.rules entry {rule!r} must be a pair (logical axis name, mesh axes)")
    logical, axes = rule
    if isinstance(axes, list | tuple):
      axes = tuple(axes)
      bad = [a for a in axes if a not in MESH_AXES]
    else:
      bad = [] if axes is None or axes in MESH_AXES else [axes]
    if bad:
      raise ConfigError(f"mesh.rules entry {rule!r}: mesh axes must be {allowed}, got {bad[0]!r}")
    rules.append((logical, axes))
  return tuple(rules)


# ---- Value checks (a ModelConfig checks itself: roformer.nn.config.validate_model) ----


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _validate_data(data: DataConfig) -> None:
  _check(
    data.source in SOURCES, f"data.source must be one of {', '.join(SOURCES)}, got {data.source!r}"
  )
  for source, names in SOURCE_FIELDS.items():
    for name in names:
      value = getattr(data, name)
      _check(
        data.source == source or not value,
        f"data.{name}={value!r} is set but data.source={data.source!r} does not read it; "
        f"set data.source={source!r} or leave data.{name} unset",
      )
  try:
    codecs.lookup(data.text_encoding)
  except LookupError:
    raise ConfigError(
      f"data.text_encoding={data.text_encoding!r} is not a known text encoding "
      "(a Python codec name such as utf-8, latin-1, cp1252)"
    ) from None
  _check(
    data.tokenizer in TOKENIZERS or data.tokenizer.endswith(".json"),
    f"data.tokenizer must be one of {', '.join(TOKENIZERS)} or a path to a tokenizer.json, "
    f"got {data.tokenizer!r}",
  )
  _check(
    data.source != "files" or bool(data.files),
    "data.files must be a glob when data.source is 'files'",
  )
  _check(
    data.source != "hub" or bool(data.hub_name),
    "data.hub_name is required when data.source is 'hub'",
  )
  _check(data.seq_len >= 1, f"data.seq_len must be >= 1, got {data.seq_len}")
  _check(data.vocab_size >= 1, f"data.vocab_size must be >= 1, got {data.vocab_size}")
  _check(
    0.0 <= data.validation_fraction < 1.0,
    f"data.validation_fraction must be in [0, 1), got {data.validation_fraction}",
  )
  _check(
    0.0 < data.mlm_probability < 1.0,
    f"data.mlm_probability must be in (0, 1), got {data.mlm_probability}",
  )
  if data.source == "synthetic":
    try:
      synthetic.check_config(data)
    except ValueError as e:
      raise ConfigError(str(e)) from e


def _validate_optim(optim: OptimConfig) -> None:
  _check(
    optim.schedule in SCHEDULES,
    f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {optim.schedule!r}",
  )
  _check(
    optim.learning_rate > 0.0,
    f"optim.learning_rate must be > 0 (at 0 no parameter would move), got {optim.learning_rate}",
  )
  _check(optim.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {optim.warmup_steps}")
  _check(
    0.0 <= optim.final_learning_rate_fraction <= 1.0,
    "optim.final_learning_rate_fraction must be in [0, 1], "
    f"got {optim.final_learning_rate_fraction}",
  )
  _check(optim.weight_decay >= 0.0, f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
  _check(0.0 <= optim.b1 < 1.0, f"optim.b1 must be in [0, 1), got {optim.b1}")
  _check(0.0 <= optim.b2 < 1.0, f"optim.b2 must be in [0, 1), got {optim.b2}")
  _check(optim.eps > 0.0, f"optim.eps must be > 0, got {optim.eps}")
  _check(
    optim.grad_clip_norm >= 0.0,
    f"optim.grad_clip_norm must be >= 0 (0 = off), got {optim.grad_clip_norm}",
  )
  _check(
    optim.grad_accum_steps >= 1,
    f"optim.grad_accum_steps must be >= 1, got {optim.grad_accum_steps}",
  )


def _validate_train(train: TrainConfig, optim: OptimConfig) -> None:
  for name in ("global_batch_size", "log_every_steps", "keep_checkpoints", "num_train_steps"):
    value = getattr(train, name)
    _check(value >= 1, f"train.{name} must be >= 1, got {value}")
  for name in (
    "eval_every_steps",
    "eval_max_tokens",
    "eval_batch_size",
    "checkpoint_every_steps",
    "seed",
  ):
    value = getattr(train, name)
    _check(value >= 0, f"train.{name} must be >= 0, got {value}")
  _check(
    train.global_batch_size % optim.grad_accum_steps == 0,
    f"train.global_batch_size ({train.global_batch_size}) must be divisible by "
    f"optim.grad_accum_steps ({optim.grad_accum_steps})",
  )


def _validate_mesh(mesh: MeshConfig) -> None:
  sizes = {name: getattr(mesh, name) for name in MESH_AXES}
  for name, size in sizes.items():
    _check(
      size == -1 or size >= 1, f"mesh.{name} must be -1 (the remaining devices) or >= 1, got {size}"
    )
  _check(
    list(sizes.values()).count(-1) <= 1,
    "at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1",
  )


def run_config_from_dict(config: Any, *, vocab_size: int | None = None) -> RunConfig:
  """Validates a whole configuration and returns it as frozen dataclasses.

  Args:
    config: a ConfigDict (configs/*.py) or the equivalent nested mapping (e.g. DIR/config.json)
      with groups model, posenc, data, optim, train, mesh.
    vocab_size: the tokenizer's vocabulary size; None keeps `model.vocab_size` of the mapping if
      present (config.json), else ModelConfig's default (only right for the bytes tokenizer).

  Returns:
    RunConfig, with the run-dependent defaults resolved from the pretraining length (the
    data.seq_len of the train.init_from run (a workdir with config.json), or the
    max_position_embeddings of the Hugging Face decoder it names, else data.seq_len):
    posenc.scaling.original_max_len 0, each used encoding's own (`PosEnc.resolve_defaults`:
    CoPE's table size) and posenc.query_scale_len 0 under "logn".

  Raises:
    ConfigError (a ValueError) naming the field and the allowed values.
  """
  values = _to_plain(config)
  try:  # the modules a workdir recorded register the encodings its run uses
    registry.import_modules(values.pop(IMPORTS_KEY, ()))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  groups = ("model", "posenc", "data", "optim", "train", "mesh")
  unknown = sorted(set(values) - set(groups))
  if unknown:
    raise ConfigError(f"unknown config group {', '.join(unknown)}; groups are {', '.join(groups)}")
  missing = [g for g in groups if g not in values]
  if missing:
    raise ConfigError(f"missing config group {', '.join(missing)}")

  data = _build(DataConfig, values["data"], "data")
  _validate_data(data)
  # The pretraining length (a fine-tune at another length keeps what depends on it).
  train_len = _init_from_seq_len(values["train"].get("init_from", "")) or data.seq_len
  posenc = _build_posenc(values["posenc"], train_len=train_len)
  model_values = dict(values["model"])
  if vocab_size is not None:
    model_values["vocab_size"] = vocab_size
  model = _build(ModelConfig, model_values, "model", posenc=posenc)
  optim = _build(OptimConfig, values["optim"], "optim")
  _validate_optim(optim)
  train = _build(TrainConfig, values["train"], "train")
  _validate_train(train, optim)
  mesh_values = dict(values["mesh"])
  rules = _rules(mesh_values.get("rules", MeshConfig.rules))
  mesh = _build(MeshConfig, mesh_values, "mesh", rules=rules)
  _validate_mesh(mesh)
  too_long = unsupported_length(model, data.seq_len)
  _check(too_long is None, str(too_long))
  _check(
    posenc.randomize_max == 0 or posenc.randomize_max >= data.seq_len,
    f"posenc.randomize_max={posenc.randomize_max} must be 0 (consecutive positions) or >= "
    f"data.seq_len={data.seq_len}: a sequence's positions are a sorted subset of [0, that)",
  )
  return RunConfig(model=model, data=data, optim=optim, train=train, mesh=mesh)


def _init_from_seq_len(init_from: Any) -> int:
  """data.seq_len of the run `train.init_from` names (its workdir, checkpoints/ or a step), the
  max_position_embeddings of a Hugging Face decoder directory (its training length, as eval.py
  --hf_model reads it), or 0."""
  if not isinstance(init_from, str) or not init_from:
    return 0
  path = epath.Path(init_from)
  # A workdir, its checkpoints/ directory, or one step directory inside that.
  candidates = [path]
  if path.name == "checkpoints":
    candidates.append(path.parent)
  elif path.parent.name == "checkpoints":
    candidates.append(path.parent.parent)
  for candidate in candidates:
    try:
      values = read_config_json(candidate)
      if values is not None and values.get("model_type") in DECODER_MODEL_TYPES:
        return int(values.get("max_position_embeddings") or 0)
      if values is not None:
        return int(values["data"]["seq_len"])
    except (ValueError, KeyError, TypeError):
      return 0
  return 0


# ---- config.json and the resume rule ----


def to_dict(run_config: RunConfig) -> dict:
  """The resolved config as plain JSON-able groups (the layout of configs/default.py)."""
  model = {
    f.name: getattr(run_config.model, f.name)
    for f in dataclasses.fields(run_config.model)
    if f.name != "posenc"
  }
  values = {
    "model": model,
    "posenc": run_config.model.posenc.to_dict(),
    "data": dataclasses.asdict(run_config.data),
    "optim": dataclasses.asdict(run_config.optim),
    "train": dataclasses.asdict(run_config.train),
    "mesh": json.loads(json.dumps(dataclasses.asdict(run_config.mesh))),
  }
  if modules := plugin_modules():
    values[IMPORTS_KEY] = sorted(modules)
  return values


def plugin_modules() -> dict[str, list[str]]:
  """module -> what it registered, of the modules outside roformer that registered encodings
  or attention kernels."""
  found = registry.plugin_modules()
  for module, names in kernel_base.plugin_modules().items():
    found.setdefault(module, []).extend(names)
  return found


def _flatten(tree: Mapping, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(_flatten(value, name + "."))
    else:
      flat[name] = value
  return flat


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, float) or isinstance(b, float):
    try:
      return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0) or a == b
    except (TypeError, ValueError):
      return False
  return json.loads(json.dumps(a)) == json.loads(json.dumps(b))


def changed_fields(old: Mapping, new: Mapping) -> list[str]:
  """Dotted names of fields that differ between two to_dict() layouts (model.vocab_size aside)."""
  flat_old, flat_new = _flatten(old), _flatten(new)
  names = sorted(set(flat_old) | set(flat_new))
  ignore = {"model.vocab_size"}
  missing = object()
  return [
    n
    for n in names
    if n not in ignore and not _same(flat_old.get(n, missing), flat_new.get(n, missing))
  ]


def _written_before_per_layer(values: Mapping) -> Mapping:
  """Runs written before CoPE and FIRE had a table / MLP per layer shared one across layers: a
  config.json without the fields reads as shared."""
  values = json.loads(json.dumps(values))
  for field in ("cope_shared", "fire_shared"):
    values.get("posenc", {}).setdefault(field, True)
  return values


def with_defaults(values: Mapping) -> Mapping:
  """A config.json's values with the defaults of fields added since it was written."""
  values = _written_before_per_layer(values)
  try:
    return to_dict(run_config_from_dict(values))
  except ConfigError:
    return values  # compared as written; the differences are reported field by field


def check_resume(old: Mapping, new: RunConfig) -> None:
  """Raises ConfigError if `new` differs from DIR/config.json beyond RESUMABLE_FIELDS."""
  old = with_defaults(old)
  new_values = to_dict(new)
  changed = [
    n
    for n in changed_fields(old, new_values)
    if n not in RESUMABLE_FIELDS and not unused_encoding_field(n, new.model.posenc)
  ]
  if changed:
    flat_old, flat_new = _flatten(old), _flatten(new_values)
    details = "; ".join(f"{n}: {flat_old.get(n)!r} -> {flat_new.get(n)!r}" for n in changed)
    raise ConfigError(
      f"this workdir holds a run with a different config ({details}). A rerun may only change "
      f"{', '.join(RESUMABLE_FIELDS)}; use a new --workdir for a different experiment"
    )


def write_config_json(workdir: str | epath.Path, run_config: RunConfig) -> None:
  try:  # eval.py and generate.py must be able to import them again
    registry.check_importable(plugin_modules())
  except ValueError as e:
    raise ConfigError(str(e)) from None
  path = epath.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / CONFIG_FILE).write_text(json.dumps(to_dict(run_config), indent=2) + "\n")


def load_run_config(workdir: str | epath.Path) -> RunConfig:
  """The resolved RunConfig a run wrote to DIR/config.json (vocab_size included)."""
  if not epath.Path(workdir).exists():
    raise FileNotFoundError(f"the workdir {workdir} does not exist")
  values = read_config_json(workdir)
  if values is None:
    raise FileNotFoundError(f"no {CONFIG_FILE} in {workdir}: is it a training workdir?")
  return run_config_from_dict(_written_before_per_layer(values))


def unused_encoding_field(name: str, posenc: PosEncConfig) -> bool:
  """Whether `name` is a field that only encodings the run's layers do not use declare
  (posenc.fire_* of a RoPE run): it cannot change the run."""
  prefix, _, field = name.partition(".")
  if prefix != "posenc" or field not in registry.encoding_fields():
    return False
  kinds = [k for k in dict.fromkeys(pattern_kinds(posenc)) if k in registry.POSENCS]
  return not any(field in registry.fields_of(k) for k in kinds)


# ModelConfig's fields that no config file sets: the tokenizer fixes the vocabulary size, and the
# encoding is a group of its own (posenc_defaults).
_MODEL_FIELDS_OUTSIDE_FILES = ("vocab_size", "posenc")


def group_fields(group: str) -> tuple[dataclasses.Field, ...]:
  """The fields of config group `group` (model, data, optim, train or mesh), each with the
  default and doc its dataclass (RunConfig's field of that name) declares."""
  groups = typing.get_type_hints(RunConfig)
  if group not in groups:
    raise KeyError(f"no config group {group!r}; groups with a dataclass: {', '.join(groups)}")
  skip = _MODEL_FIELDS_OUTSIDE_FILES if group == "model" else ()
  return tuple(f for f in dataclasses.fields(groups[group]) if f.name not in skip)


def group_defaults(group: str) -> dict:
  """Config group `group`'s fields and their defaults: that group of configs/default.py."""
  return {f.name: f.default for f in group_fields(group)}


def posenc_defaults() -> dict:
  """The posenc group's fields and defaults as nested plain values: the group of
  configs/default.py, with the fields of every encoding registered when it is called."""
  return PosEncConfig().to_dict()


def summary(run_config: RunConfig, *, num_params: int) -> str:
  """The resolved config in one line, for the startup log (config.json holds all of it)."""
  model, data, optim, train = run_config.model, run_config.data, run_config.optim, run_config.train
  kinds = dict.fromkeys(spec.posenc.kind for spec in model.layers)
  encoding = "/".join(kinds) + (" by layer" if len(kinds) > 1 else "")
  if model.posenc.scaling.kind != "none":
    encoding += f" ({model.posenc.scaling.kind} x{model.posenc.scaling.factor:g})"
  return (
    f"{model.kind}, {model.num_layers} layers x {model.emb_dim} wide, {model.num_heads} heads, "
    f"{num_params:,} parameters; encoding {encoding}; data {data.source}, tokenizer "
    f"{data.tokenizer} (vocab {model.vocab_size}), seq_len {data.seq_len}; "
    f"{train.num_train_steps} steps of {train.global_batch_size} sequences, learning rate "
    f"{optim.learning_rate:g} ({optim.schedule})"
  )
