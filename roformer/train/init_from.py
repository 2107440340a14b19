"""train.init_from: a run starts from the parameters of another run or of a Hugging Face RoFormer.

Only the model's parameters are taken; the optimizer starts fresh. A checkpoint that does not fit
this model is explained by the parameters whose shapes differ and the config fields behind them,
before Orbax reads any array.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer.errors import CheckpointNotFoundError, ConfigError
from roformer.infra import checkpoint
from roformer.nn import model as model_lib


def _is_hf_dir(path: epath.Path) -> bool:
  return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def _run_workdir(path: epath.Path) -> tuple[epath.Path, int | None] | None:
  """(workdir, step) if `path` is a run's workdir, its checkpoints/ or one checkpoint in it."""
  if (path / checkpoint.CHECKPOINT_DIR).exists():
    return path, None
  if path.name == checkpoint.CHECKPOINT_DIR:
    return path.parent, None
  if path.parent.name == checkpoint.CHECKPOINT_DIR and path.name.isdigit():
    return path.parent.parent, int(path.name)
  return None


def _place_like(source: Any, target: Any, origin: str) -> Any:
  """`source`'s arrays (matched by path) placed with the dtypes and shardings of `target`."""
  source_leaves = {
    jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(source)
  }
  target_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  problems, placed = [], []
  for path, abstract in target_leaves:
    name = jax.tree_util.keystr(path)
    value = source_leaves.get(name)
    if value is None:
      problems.append(f"{name} missing")
    elif tuple(np.shape(value)) != tuple(abstract.shape):
      problems.append(
        f"{name} has shape {tuple(np.shape(value))}, this model needs {abstract.shape}"
      )
    else:
      placed.append(jax.device_put(np.asarray(value, dtype=abstract.dtype), abstract.sharding))
  if problems:
    shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
    raise ConfigError(
      f"train.init_from={origin}: its parameters do not fit this model's config ({shown})"
    )
  return jax.tree_util.tree_unflatten(treedef, placed)


def load_init_state(init_from: str, abstract_model: Any, model_cfg=None) -> Any:
  """Model state from train.init_from, placed with the shardings of `abstract_model`.

  Args:
    init_from: another run's workdir (or its checkpoints/ dir, or one checkpoint step dir), or a
      Hugging Face RoFormerForMaskedLM directory (config.json + model.safetensors).
    abstract_model: nnx state of jax.ShapeDtypeStruct (with shardings) of this run's model.
    model_cfg: this run's ModelConfig; a checkpoint that does not fit is then explained by the
      parameters whose shapes differ and the config fields behind them.

  Raises:
    ConfigError naming train.init_from when the path is not usable or the shapes differ.
  """
  path = epath.Path(init_from)
  if not path.exists():
    raise ConfigError(f"train.init_from={init_from}: no such directory")
  run = _run_workdir(path)
  if run is not None:
    workdir, step = run
    # Shapes first: a restore into other shapes fails deep inside Orbax, after reading arrays.
    misfit = _misfit(workdir, abstract_model, model_cfg) if model_cfg is not None else ""
    if misfit:
      raise ConfigError(
        f"train.init_from={init_from}: its checkpoint does not fit this model's config ({misfit})"
      )
    try:
      state, step = checkpoint.restore_model_state(workdir, step, abstract_model)
    except CheckpointNotFoundError as e:
      raise ConfigError(f"train.init_from={init_from}: {e}") from e
    except (ValueError, KeyError) as e:
      raise ConfigError(
        f"train.init_from={init_from}: its checkpoint does not fit this model's config "
        f"({str(e).splitlines()[0]})"
      ) from None
    logging.info("Initialised parameters from %s (step %d).", workdir, step)
    return state
  if _is_hf_dir(path):
    from roformer import hf

    if "layers" in abstract_model and 0 not in abstract_model["layers"]:  # stacked blocks
      raise ConfigError(
        f"train.init_from={init_from}: Hugging Face checkpoints load only into "
        "model.scan_layers=False"
      )

    loaded = hf.load_hf_roformer(str(path))
    state = _place_like(nnx.state(loaded.model), abstract_model, init_from)
    logging.info("Initialised parameters from the Hugging Face RoFormer in %s.", path)
    return state
  raise ConfigError(
    f"train.init_from={init_from}: expected a training workdir (with "
    f"{checkpoint.CHECKPOINT_DIR}/) or a Hugging Face RoFormer directory "
    "(config.json + *.safetensors)"
  )


def _misfit(workdir: epath.Path, abstract_model: Any, model_cfg) -> str:
  """The parameters whose shapes differ between `workdir`'s run and this model, and the model
  config fields that differ (what a command-line user can change); "" if every shape fits (or
  the run's config cannot be read)."""
  try:
    source_cfg = config_lib.load_run_config(workdir).model
    source = nnx.state(nnx.eval_shape(lambda: model_lib.make_model(source_cfg, rngs=nnx.Rngs(0))))
  except (FileNotFoundError, ValueError):
    return ""

  def shapes(tree):
    return {
      jax.tree_util.keystr(path): tuple(leaf.shape)
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
      if hasattr(leaf, "shape")
    }

  there, here = shapes(source), shapes(abstract_model)
  params = [
    f"{_param_name(name)} {there.get(name, 'absent')} there, {here.get(name, 'absent')} here"
    for name in sorted(set(there) | set(here))
    if there.get(name) != here.get(name)
  ]
  if not params:
    return ""

  def flat(cfg, prefix):
    out = {}
    for field in dataclasses.fields(cfg):
      value = getattr(cfg, field.name)
      name = "posenc" if field.name == "posenc" else f"{prefix}.{field.name}"
      if dataclasses.is_dataclass(value):
        out.update(flat(value, name))
      else:
        out[name] = value
    return out

  old, new = flat(source_cfg, "model"), flat(model_cfg, "model")
  fields = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old) if old[k] != new.get(k)]
  shown = "; ".join(params[:4]) + ("; ..." if len(params) > 4 else "")
  return f"parameters {shown}; config fields {', '.join(fields) or 'none'}"


def _param_name(keystr: str) -> str:
  """ "['layers'][0]['attn']" -> "layers/0/attn"."""
  return "/".join(p.strip("'") for p in keystr.strip("[]").split("]["))
