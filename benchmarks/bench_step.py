"""The train step as train.py builds it, for the benchmarks: config, live runs, AOT compiles."""

import functools
import os
import pathlib
import statistics
import time

from configs import llama_12x768

REPO = pathlib.Path(__file__).resolve().parents[1]

# The tokenizer's vocabulary size, without training one: bytes has 261 ids.
BYTES_VOCAB = 261
# The smoke runs' model (CI): 1 layer x 32, 2 heads, 2 x 32 tokens.
SMOKE_MODEL = {
  "model.num_layers": 1,
  "model.emb_dim": 32,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
  "data.seq_len": 32,
  "train.global_batch_size": 2,
}


# The 12-layer, 768-wide Llama-style decoder of the GPU figures, as overrides of configs/lm.py.
LLAMA_12x768 = llama_12x768.FIELDS


def median_seconds(fn, repeats: int, *, warmup: bool = True) -> float:
  """Median wall seconds of `repeats` calls of fn, after one untimed call (compile, warm-up)
  unless `warmup` is False."""
  if warmup:
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def child_env() -> dict:
  """This process's environment with the repository root first on PYTHONPATH, so that a child
  started as `python -m benchmarks.<name>` finds the packages (benchmarks, configs, roformer)
  whatever its working directory, where relative paths in its arguments keep their meaning."""
  paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
  return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def apply_overrides(config, overrides: dict) -> None:
  """Sets {"group.field": value} in a (locked) ConfigDict, as --config.group.field flags would."""
  for name, value in overrides.items():
    group, field = name.split(".")
    with config.unlocked():
      config[group][field] = value


def run_config(config):
  """The frozen RunConfig of a ConfigDict, with the vocabulary size its tokenizer would have."""
  from roformer import config as config_lib

  vocab = BYTES_VOCAB if config.data.tokenizer == "bytes" else config.data.vocab_size
  return config_lib.run_config_from_dict(config, vocab_size=vocab)


def define_keep_freed_memory_flag() -> None:
  """--keep_freed_memory, for a script that can time the Hugging Face model in its process."""
  from absl import flags

  flags.DEFINE_bool(
    "keep_freed_memory",
    None,
    "glibc's malloc keeps freed memory for reuse, as train.py sets it (roformer.infra.cpu_flags)."
    " Default: on, but off where the HF model runs in this process: the setting speeds PyTorch"
    " up too, and the HF side should run as its users run it.",
  )


def keep_freed_memory(compare_hf: bool) -> bool:
  """--keep_freed_memory's value: as given, else on unless the HF model runs beside ours."""
  from absl import flags

  value = flags.FLAGS.keep_freed_memory
  return not compare_hf if value is None else value


def run_config_or_exit(prog: str, config, keep_freed_memory: bool = True):
  """`run_config(config)` after XLA's CPU flags are set as train.py sets them (before JAX
  starts; `keep_freed_memory=False` leaves glibc's malloc at its defaults); a config error is
  printed as `PROG: error: ...` and exits with status 1."""
  import sys

  from roformer.infra import cpu_flags

  cpu_flags.set_default_cpu_flags(keep_freed_memory=keep_freed_memory)
  from roformer import config as config_lib

  try:
    return run_config(config)
  except config_lib.ConfigError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    sys.exit(1)


def synthetic_batch(run_config, rng):
  """A global batch shaped like TrainBatches' (random tokens; BERT-style weights for encoders)."""
  import numpy as np

  B, L, V = run_config.train.global_batch_size, run_config.data.seq_len, run_config.model.vocab_size
  tokens_BL = rng.integers(0, V, (B, L), dtype=np.int32)
  if run_config.model.kind == "encoder":
    weights_BL = (rng.random((B, L)) < run_config.data.mlm_probability).astype(np.float32)
  else:
    weights_BL = np.ones((B, L), np.float32)
  batch = {
    "inputs": tokens_BL,
    "targets": np.roll(tokens_BL, -1, axis=1),
    "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
    "weights": weights_BL,
  }
  if run_config.data.pack:  # as TrainBatches: only packed rows carry segment ids
    batch["segment_ids"] = np.ones((B, L), np.int32)
  return batch


class JaxTrainer:
  """train_lib's train step on one synthetic batch, jitted as train.py jits it."""

  def __init__(self, run_config):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from roformer.infra import sharding
    from roformer.train import optimizer
    from roformer.train import state as train_state
    from roformer.train import step as step_lib

    self.run_config = run_config
    mesh, rules = sharding.make_mesh(run_config.mesh), sharding.axis_rules(run_config.mesh)
    tx = optimizer.make_optimizer(run_config.optim, run_config.train.num_train_steps)
    model_def, self.model_state, opt_def, self.opt_state = train_state.create_train_state(
      run_config, tx, mesh, rules
    )
    model_sh = sharding.shardings_of(self.model_state)
    opt_sh = sharding.shardings_of(self.opt_state)
    repl = sharding.replicated(mesh)
    step_fn = jax.jit(
      functools.partial(
        step_lib.train_step,
        model_def=model_def,
        opt_def=opt_def,
        **step_lib.train_step_options(run_config),
      ),
      in_shardings=(model_sh, opt_sh, sharding.batch_sharding(mesh, rules), repl),
      out_shardings=(model_sh, opt_sh, repl),
      donate_argnums=(0, 1),
    )
    local = synthetic_batch(run_config, np.random.default_rng(0))
    self.batch = sharding.put_batch(local, mesh, rules, run_config.train.global_batch_size)
    self.step = jnp.asarray(0, jnp.int32)
    start = time.perf_counter()
    lowered = step_fn.lower(self.model_state, self.opt_state, self.batch, self.step)
    self.compiled = lowered.compile()
    self.compile_seconds = time.perf_counter() - start
    cost = self.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    self.flops_per_step = float(cost.get("flops", 0.0)) if cost else 0.0

  def run(self, steps: int) -> float:
    """Runs `steps` steps; returns the seconds they took (device work included)."""
    import jax

    start = time.perf_counter()
    for _ in range(steps):
      self.model_state, self.opt_state, metrics = self.compiled(
        self.model_state, self.opt_state, self.batch, self.step
      )
    jax.block_until_ready((self.model_state, metrics))
    return time.perf_counter() - start


class DoesNotFitError(Exception):
  """The TPU compiler found that the step needs more memory than the chip has."""


def compile_train_step(run_config, devices, dump_dir: str | None = None) -> dict:
  """Lowers and compiles train_lib's train step for `devices`; returns memory and timing.
  `dump_dir`: where XLA writes the compiled HLO and its buffer assignment (`memory_report.py`)."""
  import jax
  import jax.numpy as jnp

  from roformer.infra import sharding
  from roformer.train import optimizer
  from roformer.train import state as train_state
  from roformer.train import step as step_lib

  mesh = sharding.make_mesh(run_config.mesh, devices=devices)
  rules = sharding.axis_rules(run_config.mesh)
  tx = optimizer.make_optimizer(run_config.optim, run_config.train.num_train_steps)
  model_def, model_abs, opt_def, opt_abs = train_state.abstract_train_state(
    run_config, tx, mesh, rules
  )
  model_sh, opt_sh = sharding.shardings_of(model_abs), sharding.shardings_of(opt_abs)
  batch_sh, repl = sharding.batch_sharding(mesh, rules), sharding.replicated(mesh)
  B, L = run_config.train.global_batch_size, run_config.data.seq_len
  ways = sharding.batch_axis_size(mesh, rules)
  micro_batch = B // run_config.optim.grad_accum_steps
  if micro_batch % ways:
    raise ValueError(
      f"train.global_batch_size / optim.grad_accum_steps = {micro_batch} "
      f"must be divisible by the {ways} ways the batch is split over the mesh ({dict(mesh.shape)})"
    )
  batch = {
    name: jax.ShapeDtypeStruct(
      (B, L), jnp.float32 if name == "weights" else jnp.int32, sharding=batch_sh
    )
    for name in ("inputs", "targets", "positions", "weights")
    + (("segment_ids",) if run_config.data.pack else ())
  }
  step_fn = jax.jit(
    functools.partial(
      step_lib.train_step,
      model_def=model_def,
      opt_def=opt_def,
      **step_lib.train_step_options(run_config),
    ),
    in_shardings=(model_sh, opt_sh, batch_sh, repl),
    out_shardings=(model_sh, opt_sh, repl),
    donate_argnums=(0, 1),
  )
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = step_fn.lower(model_abs, opt_abs, batch, step)
    try:
      compiled = lowered.compile(None if dump_dir is None else {"xla_dump_to": dump_dir})
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses programs past the HBM
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise DoesNotFitError(str(e).splitlines()[0]) from e
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  argument = memory.argument_size_in_bytes
  temp = memory.temp_size_in_bytes
  output = memory.output_size_in_bytes - memory.alias_size_in_bytes  # donated outputs reuse
  num_params = sum(x.size for x in jax.tree.leaves(model_abs))
  return {
    "compile_seconds": seconds,
    "mesh": dict(mesh.shape),
    "num_params": int(num_params),
    "argument_bytes": int(argument),
    "temp_bytes": int(temp),
    "output_bytes": int(output),
    "total_bytes": int(argument + temp + output),
  }
