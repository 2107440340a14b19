"""What every Hugging Face importer shares: reading config.json and safetensors without torch,
converting HF tensors to our parameter layout, and filling a model's parameters with them.

An importer supplies a ModelConfig and a table from each of our parameter paths to (HF tensor
name, rule); this module checks shapes, dtypes and finiteness, reports every missing or unused
tensor at once, and builds the model without a random initialisation.
"""

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import ml_dtypes  # importing it registers bfloat16 with numpy; safetensors then reads bf16
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file as _load_numpy

from roformer.errors import ConfigError
from roformer.nn.config import ModelConfig
from roformer.nn.model import DTYPES, make_model

# ModelConfig fields that change no parameter, so they may differ from the checkpoint's.
OVERRIDABLE_FIELDS = (
  "dtype",
  "param_dtype",
  "attention_impl",
  "attention_block",
  "attention_window",
  "dropout_rate",
  "attention_dropout_rate",
  "posenc",
)


class HFConversionError(ConfigError):
  """A checkpoint this importer cannot convert faithfully (the message says which part and why)."""


def read_hf_config(path) -> dict:
  """The parsed config.json of an HF checkpoint directory."""
  config_file = pathlib.Path(path) / "config.json"
  if not config_file.exists():
    raise HFConversionError(f"no config.json in {path}")
  return _read_json(config_file)


def _read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise HFConversionError(f"{path} is not valid JSON ({e})") from None


def check_overrides(overrides: Mapping) -> None:
  unknown = sorted(set(overrides) - set(OVERRIDABLE_FIELDS))
  if unknown:
    raise HFConversionError(
      f"cannot override {unknown} when loading a checkpoint; allowed: {list(OVERRIDABLE_FIELDS)}"
    )


def model_config(fields: Mapping, overrides: Mapping) -> ModelConfig:
  """ModelConfig(**fields, **overrides); a value it refuses becomes an HFConversionError."""
  check_overrides(overrides)
  try:
    return ModelConfig(**{**fields, **overrides})
  except ValueError as e:
    raise HFConversionError(f"the checkpoint's config maps to an invalid model: {e}") from None


def load_hf_tensors(path) -> dict[str, np.ndarray]:
  """All tensors of `path`/model.safetensors (or its sharded index), as numpy arrays.

  Arrays keep their stored dtype (bfloat16 as `ml_dtypes.bfloat16`). The LayerNorm `gamma`/`beta`
  names of old BERT-style exports become `weight`/`bias`.
  """
  path = pathlib.Path(path)
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(_read_json(index).get("weight_map", {}).values()))
  elif (path / "model.safetensors").exists():
    files = ["model.safetensors"]
  else:
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    raise HFConversionError(
      f"no model.safetensors (or model.safetensors.index.json) in {path}; found {found}. "
      "Re-save the model with transformers' save_pretrained (safetensors) first"
    )
  tensors = {}
  for name in files:
    try:
      loaded = _load_numpy(path / name)
    except (SafetensorError, OSError) as e:  # e.g. a download cut short: "incomplete metadata"
      raise HFConversionError(
        f"{path / name} is not a readable safetensors file ({e}); download or save it again"
      ) from None
    for key, value in loaded.items():
      if key.endswith(".gamma"):
        key = key[: -len("gamma")] + "weight"
      elif key.endswith(".beta"):
        key = key[: -len("beta")] + "bias"
      tensors[key] = value
  return tensors


# ---- Tensors to parameters ----

# How an HF tensor becomes one of our parameters: (HF shape from our shape, conversion).
# torch Linear stores weight [out, in]; flax kernels are [in, out]. HF splits the q/k/v output
# features (and the attention-output input features) as head * head_dim + k.
Rule = tuple[Callable[[tuple], tuple], Callable[[np.ndarray, tuple], np.ndarray]]
RULES: dict[str, Rule] = {
  "copy": (lambda s: s, lambda a, s: a),
  "linear": (lambda s: s[::-1], lambda a, s: a.T),
  "heads_in": (lambda s: (s[1] * s[2], s[0]), lambda a, s: a.T.reshape(s)),
  "heads_bias": (lambda s: (s[0] * s[1],), lambda a, s: a.reshape(s)),
  "heads_out": (lambda s: (s[2], s[0] * s[1]), lambda a, s: a.T.reshape(s)),
}


def _is_float(dtype) -> bool:
  # bfloat16 is not a numpy floating subtype, so np.issubdtype alone would reject it.
  return np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16


def tensor_problem(name: str, array: np.ndarray, hf_shape: tuple) -> str | None:
  """Why `array` cannot be the tensor `name` of shape `hf_shape`, or None."""
  if array.shape != tuple(hf_shape):
    return f"{name} has shape {array.shape}, the config needs {tuple(hf_shape)}"
  if not _is_float(array.dtype):
    return f"{name} has dtype {array.dtype}, expected a float dtype"
  if not np.isfinite(array.astype(np.float32)).all():
    return f"{name} contains NaN or inf values"
  return None


def mismatch(name: str, array: np.ndarray, expected: np.ndarray, what: str) -> str | None:
  """Why the stored `array` is not `expected` (described by `what`), or None.

  Compared at the stored precision: a bfloat16 checkpoint holds a rounded copy.
  """
  problem = tensor_problem(name, array, expected.shape)
  if problem is None:
    rounded = np.asarray(expected).astype(array.dtype).astype(np.float32)
    if not np.allclose(array.astype(np.float32), rounded, rtol=0, atol=1e-5):
      problem = f"{name} differs from {what}"
  return problem


@dataclasses.dataclass
class Mapped:
  """The result of `map_params`: our parameters and what went wrong on the way.

  Attributes:
    params: our parameter path -> float32 array in our layout.
    used: the HF tensor names that filled a parameter or passed a check.
    missing: HF names the config needs and the checkpoint lacks.
    problems: one line per mis-shaped, non-float, non-finite or mismatched tensor.
  """

  params: dict[tuple, np.ndarray] = dataclasses.field(default_factory=dict)
  used: set[str] = dataclasses.field(default_factory=set)
  missing: list[str] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)

  def check_derived(self, tensors: Mapping[str, np.ndarray], checks: Mapping) -> None:
    """Checks stored tensors that fill no parameter but must equal what the model computes.

    `checks` maps an HF name to (a function returning the expected array or None, a description);
    a name absent from the checkpoint or already used as a parameter is skipped.
    """
    for name, (expected_fn, what) in checks.items():
      if name not in tensors or name in self.used:
        continue
      self.used.add(name)
      expected = expected_fn()
      problem = None if expected is None else mismatch(name, tensors[name], expected, what)
      if problem:
        self.problems.append(problem)

  def raise_if_bad(self, tensors: Mapping[str, np.ndarray], model_name: str) -> None:
    """Raises naming every missing, unused, mis-shaped or non-finite tensor."""
    if self.missing:
      raise HFConversionError(
        f"the checkpoint lacks {len(self.missing)} tensor(s) that the config needs: {self.missing}"
      )
    unused = sorted(set(tensors) - self.used)
    if unused:
      self.problems.append(
        f"{len(unused)} tensor(s) have no place in the {model_name} (unsupported checkpoint or "
        f"config mismatch): {unused}"
      )
    if self.problems:
      raise HFConversionError("cannot convert the checkpoint: " + "; ".join(self.problems))


def map_params(
  tensors: Mapping[str, np.ndarray],
  sources: Mapping[tuple, tuple[str, str]],
  param_shapes: Mapping[tuple, tuple],
) -> Mapped:
  """Converts the HF tensor of each of our parameters by its rule.

  Args:
    tensors: HF name -> array (`load_hf_tensors`).
    sources: our parameter path -> (HF tensor name, rule name in RULES).
    param_shapes: our parameter path (as in `nnx.to_flat_state`) -> shape.

  Returns:
    A `Mapped` with float32 parameters in our layout, the HF names used, and the problems.
  """
  out = Mapped()
  for path, shape in param_shapes.items():
    if path not in sources:
      out.problems.append(f"model parameter {'.'.join(map(str, path))} has no HF counterpart")
      continue
    name, rule = sources[path]
    hf_shape, convert = RULES[rule]
    if name not in tensors:
      out.missing.append(name)
      continue
    out.used.add(name)
    problem = tensor_problem(name, tensors[name], hf_shape(shape))
    if problem:
      out.problems.append(problem)
    else:
      out.params[path] = convert(np.asarray(tensors[name], dtype=np.float32), shape)
  return out


# ---- Model ----


def abstract_params(cfg: ModelConfig):
  """(graphdef, flat state, our parameter path -> shape) of `make_model(cfg)`, built abstractly:
  the parameter tree and shapes without paying for a random initialisation."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))))
  flat = nnx.to_flat_state(state)
  others = [".".join(map(str, p)) for p, v in flat if not isinstance(v, nnx.Param)]
  if others:
    raise HFConversionError(f"the model has non-parameter state {others} that no HF tensor fills")
  return graphdef, flat, {p: tuple(v.get_value().shape) for p, v in flat}


def fill_model(graphdef, flat, params: Mapping[tuple, np.ndarray], cfg: ModelConfig):
  """The model of `abstract_params` with every parameter set from `params` (param_dtype)."""
  param_dtype = DTYPES[cfg.param_dtype]
  for p, v in flat:
    v.set_value(jnp.asarray(params[p], dtype=param_dtype))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
