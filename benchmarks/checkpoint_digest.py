"""What a checkpoint's manifest costs (roformer/infra/manifest.py): the SHA-256 digest of every
file, written when a step is saved and checked before every restore.

The 12 x 768 decoder of the GPU figures (bench_step.LLAMA_12x768; float32 parameters and AdamW
moments, random as after training) is saved into --dir as train.py saves it; the table gives
the checkpoint's size and the seconds (median of --repeats) of the save with its manifest, the
manifest written again alone, its check, and a restore of the model and optimizer, each with the
rate in GB/s of checkpoint bytes.

  JAX_PLATFORMS=cpu python -m benchmarks.checkpoint_digest [--dir=/tmp/digest] [--repeats=3]
  JAX_PLATFORMS=cpu python -m benchmarks.checkpoint_digest --smoke   # a 1 x 32 model
"""

import functools
import shutil
import tempfile

from absl import app, flags

flags.DEFINE_string("dir", "", "Workdir for the checkpoint (default: a temporary directory).")
flags.DEFINE_integer("repeats", 3, "Timed repeats of each row (median).")
flags.DEFINE_bool("smoke", False, "A 1-layer, 32-wide model instead of 12 x 768.")
FLAGS = flags.FLAGS
SMOKE_MODEL = {
  "model.num_layers": 1,
  "model.emb_dim": 32,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
}


def _train_state(smoke: bool):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks import bench_step
  from configs import lm
  from roformer.infra import sharding
  from roformer.train import optimizer, state

  config = lm.get_config()
  overrides = {**bench_step.LLAMA_12x768, **(SMOKE_MODEL if smoke else {})}
  bench_step.apply_overrides(config, overrides)
  run_config = bench_step.run_config(config)
  mesh, rules = sharding.make_mesh(run_config.mesh), sharding.axis_rules(run_config.mesh)
  tx = optimizer.make_optimizer(run_config.optim, run_config.train.num_train_steps)
  _, model_state, _, opt_state = state.create_train_state(run_config, tx, mesh, rules)
  _, model_abs, _, opt_abs = state.abstract_train_state(run_config, tx, mesh, rules)
  # Moments as after training: fresh ones are zeros, which the checkpoint compresses away.
  rng = np.random.default_rng(0)

  def moment(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jax.device_put((1e-3 * rng.standard_normal(x.shape)).astype(x.dtype), x.sharding)

  return run_config, (model_state, jax.tree.map(moment, opt_state)), (model_abs, opt_abs)


def measure(workdir, model_state, opt_state, model_abs, opt_abs, *, repeats: int):
  """Saves the state into `workdir` as train.py does and times each row.

  Returns:
    (checkpoint bytes, number of files, [(what, seconds)]).
  """
  from etils import epath

  from benchmarks import bench_step
  from roformer.infra import checkpoint, manifest

  manager = checkpoint.make_manager(workdir, keep=1)
  steps = iter(range(1, 1 << 30))

  def save():
    checkpoint.save(manager, next(steps), model_state, opt_state, {"step": 0})
    checkpoint.wait_until_saved(manager)

  timed = functools.partial(bench_step.median_seconds, warmup=False)  # each call is new work
  rows = [("save, manifest included", timed(save, repeats))]
  step = manager.latest_step()
  step_dir = checkpoint.checkpoint_dir(workdir) / str(step)
  files = [folder / name for folder, _, names in epath.Path(step_dir).walk() for name in names]
  size = sum(f.stat().length for f in files)
  rows.append(("manifest written", timed(lambda: manifest.write(step_dir), 1)))
  rows.append(("manifest checked", timed(lambda: manifest.verify(step_dir), 1)))
  restore = lambda: checkpoint.restore(manager, step, model_abs, opt_abs)  # noqa: E731
  rows.append(("restore (no check)", timed(restore, repeats)))
  checkpoint.close(manager)
  return size, len(files), rows


def main(argv):
  del argv
  from roformer.infra import manifest
  from roformer.train import state

  run_config, (model_state, opt_state), (model_abs, opt_abs) = _train_state(FLAGS.smoke)
  workdir = FLAGS.dir or tempfile.mkdtemp(prefix="checkpoint_digest_")
  size, count, rows = measure(
    workdir, model_state, opt_state, model_abs, opt_abs, repeats=FLAGS.repeats
  )
  m = run_config.model
  print(
    f"{m.num_layers} x {m.emb_dim} decoder, {state.count_params(model_state):,} parameters; "
    f"checkpoint {size / 1e9:.3f} GB in {count} files ({manifest.ALGORITHM} digests; the files "
    "were just written, so read from the page cache)\n"
  )
  print("| what | seconds | GB/s |")
  print("|---|---|---|")
  for name, seconds in rows:
    print(f"| {name} | {seconds:.3f} | {size / 1e9 / seconds:.2f} |")
  if not FLAGS.dir:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
