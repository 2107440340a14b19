"""A finished run opened for inference: its config as evaluated, its checkpoint, its limits.

Evaluation (roformer/evals/) and generation (roformer/generate.py) read a run through this module:
the run's config.json, the model restored from a checkpoint onto this machine's devices, and the
evaluation-time changes that keep the parameters (a RoPE scaling, an attention window, a
blockwise kernel). A Hugging Face causal LM directory opens as a run too (`open_hf_model`).
"""

import dataclasses
from typing import Any

import jax
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer import hf
from roformer.config import RunConfig
from roformer.data.config import DataConfig
from roformer.data.tokenizer import TOKENIZER_FILE
from roformer.errors import ConfigError
from roformer.infra import checkpoint, sharding
from roformer.infra import workdir as workdir_lib
from roformer.nn import config as nn_config
from roformer.nn import model as model_lib
from roformer.posenc import POSENCS
from roformer.posenc.config import EXTENSION_FIELDS, ContextExtension, RopeScaling
from roformer.posenc.rope_scaling import SCALING_KINDS


def eval_mesh(run_config: RunConfig):
  """The run's mesh if this machine's device count fits it, else all devices on 'data'."""
  try:
    return sharding.make_mesh(run_config.mesh)
  except ConfigError:
    return sharding.make_mesh(config_lib.MeshConfig(data=-1, fsdp=1, tensor=1))


def restore_model(
  workdir: str | epath.Path, *, step: int | None = None, run_config: RunConfig | None = None
) -> tuple[Any, int]:
  """The model of a training run's checkpoint, for evaluation.

  Args:
    workdir: the run's workdir (holding config.json and checkpoints/).
    step: the checkpoint's step; None = the latest.
    run_config: overrides DIR/config.json (e.g. with a RoPE scaling for evaluation; parameter
      shapes must not change).

  Returns:
    (model, step): the nnx model with its parameters sharded over this machine's devices.

  Raises:
    CheckpointNotFoundError: "no checkpoint in DIR/checkpoints" (or no such step).
  """
  workdir = epath.Path(workdir)
  run_config = run_config or config_lib.load_run_config(workdir)
  mesh = eval_mesh(run_config)
  rules = sharding.axis_rules(run_config.mesh)
  make = lambda: model_lib.make_model(run_config.model, rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, abstract = sharding.abstract_state(make, mesh, rules)
  state, step = checkpoint.restore_model_state(workdir, step, abstract)
  return nnx.merge(graphdef, state), step


def eval_model_config(
  model_cfg,
  *,
  seq_len: int,
  rope_scaling: str = "none",
  rope_factor: float = 1.0,
  rope_fields: dict | None = None,
  attention_window: int = 0,
  window_kind: str = "sliding",
  extension: ContextExtension | None = None,
  query_scale: str = "none",
):
  """The run's ModelConfig as evaluated: any RoPE scaling or attention window applied, and a
  blockwise attention kernel.

  Args:
    model_cfg: the run's ModelConfig.
    seq_len: the training length (the scaling's original_max_len).
    rope_scaling: a RopeScaling kind, or "none" to keep the run's encoding as trained.
    rope_factor: the scaling factor.
    rope_fields: other posenc.scaling fields of the scaling (beta_fast, beta_slow, ramp_len).
    attention_window, window_kind: an attention window imposed at evaluation (0 = as trained),
      e.g. xPos's blockwise causal attention (window_kind "blockwise", window = seq_len).
    extension: a training-free context extension (`roformer.posenc.extension`); None keeps the
      run's positions. Its train_len 0 becomes `seq_len`.
    query_scale: a parameter-free query temperature ("logn", "llama4") on every layer, with the
      training length as logn's L0 and llama4's floor_scale; "none" keeps the run's.

  Returns:
    A ModelConfig with the same parameters as `model_cfg`.
  """
  posenc = model_cfg.posenc
  if rope_scaling != "none":
    if rope_scaling not in SCALING_KINDS:
      raise ValueError(f"--rope_scaling must be one of {SCALING_KINDS}, got {rope_scaling!r}")
    if not POSENCS[posenc.kind].accepts_rope_scaling:
      raise ValueError(
        f"--rope_scaling rescales RoPE frequencies, but this run has posenc.kind={posenc.kind!r} "
        "(only rotary runs can be scaled)"
      )
    scaling = RopeScaling(
      kind=rope_scaling, factor=float(rope_factor), original_max_len=seq_len, **(rope_fields or {})
    )
    posenc = dataclasses.replace(posenc, scaling=scaling)
  if extension is not None:
    # The ModelConfig built below validates it (rotary encodings, causal softmax attention).
    if "train_len" in EXTENSION_FIELDS[extension.kind] and not extension.train_len:
      extension = dataclasses.replace(extension, train_len=seq_len)
    posenc = dataclasses.replace(posenc, extension=extension)
  if query_scale != "none":
    if posenc.query_scale != "none":
      raise ValueError(
        f"--query_scale={query_scale}: this run already trained with "
        f"posenc.query_scale={posenc.query_scale!r}"
      )
    # The ModelConfig built below refuses it for an encoder (a query sees all n keys only when
    # causal).
    posenc = dataclasses.replace(
      posenc,
      query_scale=query_scale,
      query_scale_len=seq_len,
      query_scale_floor=float(seq_len),
      query_scale_kinds="",
    )
  window = {}
  if attention_window:
    if attention_window < 0:
      raise ValueError(f"--window must be > 0, got {attention_window}")
    # Every layer: a per-layer pattern of the run gives way to the imposed window.
    window = dict(
      attention_window=attention_window,
      attention_window_kind=window_kind,
      attention_window_pattern="",
    )
  # The dense kernel materialises [L, L] scores; "auto" is the same kernel for short windows.
  impl = "auto" if model_cfg.attention_impl == "dense" else model_cfg.attention_impl
  return dataclasses.replace(model_cfg, posenc=posenc, attention_impl=impl, **window)


def with_config(model, cfg):
  """`model`'s parameters in a model built from `cfg` (same parameters, other static settings)."""
  abstract = nnx.eval_shape(lambda: model_lib.make_model(cfg, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract)
  return nnx.merge(graphdef, nnx.state(model))


def unsupported_length(model_cfg, length: int) -> str | None:
  """Why `model_cfg` cannot run windows of `length` (e.g. a learned table too short), or None."""
  randomize_max = model_cfg.posenc.randomize_max
  if randomize_max and length > randomize_max:
    return (
      f"a run trained with randomized positions is evaluated at a sorted subset of [0, "
      f"posenc.randomize_max={randomize_max}), which has no {length} distinct positions"
    )
  return nn_config.unsupported_length(model_cfg, length)


def restore_for_eval(workdir, run_config, model_cfg, *, step: int | None = None):
  """Restores the checkpoint's weights into a model built from `model_cfg` (same parameters).

  Returns:
    (model, step).
  """
  run_config = dataclasses.replace(run_config, model=model_cfg)
  return restore_model(workdir, step=step, run_config=run_config)


def open_hf_model(path) -> tuple[RunConfig, Any]:
  """A Hugging Face causal LM directory opened as a finished run: (its RunConfig, its Decoder).

  The RunConfig holds the library's defaults but for the imported model (`hf.load_hf_decoder`),
  the directory's tokenizer.json as data.tokenizer, and the checkpoint's context length
  (config.json max_position_embeddings) as data.seq_len: the "training length" of the default
  evaluation lengths, of `--rope_factor=auto` and of a scaling's original length. The parameters
  are placed over this machine's devices as a restored run's are.

  Raises:
    ConfigError: no tokenizer.json or max_position_embeddings, or a config.json field or tensor
      the importer refuses (`hf.HFConversionError`), naming it.
  """
  path = epath.Path(workdir_lib.resolve(str(path), flag="--hf_model"))
  tokenizer = path / TOKENIZER_FILE
  if not tokenizer.exists():
    raise ConfigError(
      f"--hf_model={path} has no {TOKENIZER_FILE}: its tokenizer is the one evaluated with "
      "(save it with the model's tokenizer.save_pretrained)"
    )
  seq_len = int(hf.read_hf_config(path).get("max_position_embeddings") or 0)
  if seq_len < 1:
    raise ConfigError(f"--hf_model={path}: config.json has no max_position_embeddings")
  model = hf.load_hf_decoder(path)
  run_config = RunConfig(
    model=model.cfg,
    data=DataConfig(tokenizer=str(tokenizer), seq_len=seq_len),
    optim=config_lib.OptimConfig(),
    train=config_lib.TrainConfig(),
    mesh=config_lib.MeshConfig(),
  )
  mesh = eval_mesh(run_config)
  make = lambda: model_lib.make_model(model.cfg, rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, abstract = sharding.abstract_state(make, mesh, sharding.axis_rules(run_config.mesh))
  # The same tree in the same order: each array goes where the abstract state says.
  targets, treedef = jax.tree.flatten(abstract)
  values = jax.tree.leaves(nnx.state(model))
  placed = [jax.device_put(v, t.sharding) for v, t in zip(values, targets, strict=True)]
  return run_config, nnx.merge(graphdef, jax.tree.unflatten(treedef, placed))
