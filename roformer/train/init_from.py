"""train.init_from: a run starts from the parameters of another run, of a Hugging Face RoFormer,
or of a Hugging Face decoder (Llama, Mistral, Qwen2, GPT-NeoX).

Only the model's parameters are taken; the optimizer starts fresh. A checkpoint that does not fit
this model is explained by the parameters whose shapes differ and the config fields behind them,
before Orbax reads any array. A Hugging Face decoder's config.json fixes the model: a run whose
config differs in a field that changes the numbers is refused, naming the first such field,
before anything is compiled.
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
from roformer.nn import config as nn_config
from roformer.nn import model as model_lib
from roformer.nn.config import ModelConfig
from roformer.posenc.config import PosEncConfig


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
      Hugging Face RoFormerForMaskedLM or causal LM directory (config.json + *.safetensors; a
      decoder's config was checked by `hf_decoder_model`).
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

    model_type = hf.read_hf_config(path).get("model_type")
    try:
      if model_type in hf.DECODER_MODEL_TYPES:
        loaded = hf.load_hf_decoder(str(path))
      else:
        loaded = hf.load_hf_roformer(str(path)).model
    except hf.HFConversionError as e:
      raise ConfigError(f"train.init_from={init_from}: {e}") from None
    state = _place_like(nnx.state(loaded), abstract_model, init_from)
    logging.info("Initialised parameters from the Hugging Face %s in %s.", model_type, path)
    return state
  raise ConfigError(
    f"train.init_from={init_from}: expected a training workdir (with "
    f"{checkpoint.CHECKPOINT_DIR}/) or a Hugging Face RoFormer or decoder directory "
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

  old, new = _config_fields(source_cfg), _config_fields(model_cfg)
  fields = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old) if old[k] != new.get(k)]
  shown = "; ".join(params[:4]) + ("; ..." if len(params) > 4 else "")
  return f"parameters {shown}; config fields {', '.join(fields) or 'none'}"


def _param_name(keystr: str) -> str:
  """ "['layers'][0]['attn']" -> "layers/0/attn"."""
  return "/".join(p.strip("'") for p in keystr.strip("[]").split("]["))


def _config_fields(cfg, prefix: str = "model") -> dict:
  """A ModelConfig's fields by their config names (model.*, posenc.*, posenc.scaling.*), in the
  order of the dataclasses."""
  out = {}
  if isinstance(cfg, PosEncConfig):  # its encodings' fields are registered, not dataclass fields
    items = cfg.items()
  else:
    items = [(field.name, getattr(cfg, field.name)) for field in dataclasses.fields(cfg)]
  for field_name, value in items:
    name = "posenc" if field_name == "posenc" else f"{prefix}.{field_name}"
    if dataclasses.is_dataclass(value):
      out.update(_config_fields(value, name))
    else:
      out[name] = value
  return out


# ---- A Hugging Face decoder: its config.json fixes the model ----

# Fields a fine-tune of an imported decoder chooses itself: precision, kernels, dropout and
# recomputation change no parameter. The vocabulary size is the checkpoint's (`_setup` sets it;
# the tokenizer's ids must fit in it).
FINE_TUNE_FIELDS = (
  "model.vocab_size", "model.dtype", "model.param_dtype", "model.attention_impl",
  "model.attention_block", "model.dropout_rate", "model.attention_dropout_rate", "model.remat",
)  # fmt: skip


def hf_decoder_model(init_from: str, model_cfg: ModelConfig) -> ModelConfig | None:
  """The ModelConfig of the Hugging Face decoder in `init_from`, once this run's is checked
  against it; None if `init_from` is not a Hugging Face decoder directory.

  The checkpoint's config.json, mapped as `hf.load_hf_decoder` maps it (`hf.hf_decoder_config`),
  fixes every field that changes the numbers. The run chooses FINE_TUNE_FIELDS, and may set a
  posenc.scaling (PI, YaRN, ... to extend the context), which replaces the checkpoint's own; a
  run with posenc.scaling.kind='none' keeps the checkpoint's, which must then be none too.
  Fields of encodings the checkpoint does not use (posenc.xpos_*, ...) are not compared.
  "0 = default" fields compare by what they resolve to (model.head_dim=0 is emb_dim // num_heads).

  Raises:
    ConfigError naming train.init_from, the first field that differs and both values; or the
      config.json field the importer cannot reproduce.
  """
  path = epath.Path(init_from)
  if not _is_hf_dir(path):
    return None
  from roformer import hf

  hf_config = hf.read_hf_config(path)
  if hf_config.get("model_type") not in hf.DECODER_MODEL_TYPES:
    return None
  try:
    checkpoint_cfg = hf.hf_decoder_config(hf_config)
  except hf.HFConversionError as e:
    raise ConfigError(f"train.init_from={init_from}: {e}") from None
  difference = _first_difference(model_cfg, checkpoint_cfg)
  if difference:
    name, ours, theirs = difference
    raise ConfigError(
      f"train.init_from={init_from}: this run's {name}={ours!r} differs from the Hugging Face "
      f"checkpoint's {name}={theirs!r} (its config.json fixes the model; "
      f"--config=configs/hf_decoder.py:{init_from} sets every such field)"
    )
  return checkpoint_cfg


def _comparable_fields(cfg: ModelConfig) -> dict:
  fields = _config_fields(cfg)
  fields["model.head_dim"] = nn_config.resolve_head_dim(cfg)
  fields["model.num_kv_heads"] = nn_config.resolve_num_kv_heads(cfg)
  fields["model.embed_scale"] = nn_config.resolve_embed_scale(cfg)
  return fields


def _first_difference(run: ModelConfig, checkpoint: ModelConfig) -> tuple | None:
  """(name, run's value, checkpoint's value) of the first field that must match and does not."""
  ours, theirs = _comparable_fields(run), _comparable_fields(checkpoint)
  keeps_scaling = run.posenc.scaling.kind == "none"
  for name, value in theirs.items():
    if name in FINE_TUNE_FIELDS or config_lib.unused_encoding_field(name, checkpoint.posenc):
      continue
    if name.startswith("posenc.scaling.") and not (keeps_scaling and name == "posenc.scaling.kind"):
      continue
    if ours[name] != value:
      return name, ours[name], value
  return None


def check_tokenizer_fits(init_from: str, vocab_size: int, tokenizer, data_cfg) -> None:
  """Refuses a tokenizer that would feed ids the checkpoint has no embedding for.

  A decoder run feeds the ids text gives, the end-of-text id that joins documents and, with
  data.pack, the pad id of unused row slots. A tokenizer may have fewer ids than the checkpoint
  has rows (vocabularies padded to a multiple of 64 or 128); an imported tokenizer.json without a
  special token gets one added after its vocabulary (roformer/data/tokenizer.py).

  Raises:
    ConfigError naming data.tokenizer (or data.pack) and the id.
  """
  fed = {"text": int(tokenizer.regular_ids.max(initial=0)), "end-of-text": tokenizer.eos_id}
  if data_cfg.pack:
    fed["padding (data.pack=True)"] = tokenizer.pad_id
  for what, token_id in fed.items():
    if token_id >= vocab_size:
      raise ConfigError(
        f"data.tokenizer={data_cfg.tokenizer} gives {what} id {token_id}, beyond the "
        f"vocabulary of {vocab_size} of train.init_from={init_from}: train with the checkpoint's "
        "own tokenizer.json" + (" or data.pack=False" if what.startswith("padding") else "")
      )
