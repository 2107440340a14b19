"""Training-step speed, memory and compile time of the long-context and deep-model options.

Three tables, each from the real train step (as train.py jits it) of a decoder 4 x 256 wide
(4 heads, MLP 1024, bytes vocabulary) on this machine's devices:

  attention  dense against chunked attention: seconds per step and XLA temporaries per length.
  remat      XLA's planned temporary memory of one training step at --remat_length tokens, for
             model.remat none | block | full (compiled only, not run).
  compile    compile time of a --deep_layers model with model.scan_layers False against True.

  JAX_PLATFORMS=cpu python -m benchmarks.train_memory [--tables=attention,remat,compile]
    [--lengths=1024,4096] [--remat_length=8192] [--deep_layers=24] [--steps=2]
"""

import statistics
import sys

from absl import app, flags

flags.DEFINE_list("tables", ["attention", "remat", "compile"], "Which tables to print.")
flags.DEFINE_list("lengths", ["1024", "4096"], "attention: sequence lengths.")
flags.DEFINE_integer("batch", 1, "Sequences per step.")
flags.DEFINE_integer("steps", 2, "attention: timed steps per kernel (median).")
flags.DEFINE_integer("remat_length", 8192, "remat: sequence length.")
flags.DEFINE_string("remat_attention_impl", "auto", "remat: model.attention_impl.")
flags.DEFINE_integer("deep_layers", 24, "compile: number of layers.")
flags.DEFINE_bool(
  "smoke", False, "SMOKE_MODEL instead of MODEL: CI's check that every table prints."
)
FLAGS = flags.FLAGS
MIB = 1024**2
# The model of the tables (the compile table sets its own depth); --smoke's for CI.
MODEL = {"model.num_layers": 4, "model.emb_dim": 256, "model.num_heads": 4, "model.mlp_dim": 1024}
SMOKE_MODEL = {
  "model.num_layers": 2,
  "model.emb_dim": 32,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
}


def _run_config(**overrides):
  from configs import default
  from roformer import config as config_lib

  config = default.get_config()
  fields = {
    **(SMOKE_MODEL if FLAGS.smoke else MODEL),
    "train.global_batch_size": FLAGS.batch,
    "optim.warmup_steps": 0,
    **overrides,
  }
  with config.unlocked():
    for name, value in fields.items():
      group, field = name.split(".")
      config[group][field] = value
  return config_lib.run_config_from_dict(config, vocab_size=261)


def _table(header, rows):
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
  return "\n".join(lines)


def attention_table() -> str:
  import jax

  from benchmarks import bench_step

  rows = []
  for length in map(int, FLAGS.lengths):
    for impl in ("dense", "chunked"):
      run_config = _run_config(**{"data.seq_len": length, "model.attention_impl": impl})
      memory = bench_step.compile_train_step(run_config, jax.devices())
      trainer = bench_step.JaxTrainer(run_config)
      trainer.run(1)
      seconds = statistics.median(trainer.run(1) for _ in range(FLAGS.steps))
      rows.append(
        [length, impl, f"{seconds:.2f}", f"{FLAGS.batch * length / seconds:,.0f}",
         f"{memory['temp_bytes'] / MIB:,.0f}"]
      )  # fmt: skip
      del trainer
  return _table(["length", "kernel", "s/step", "tokens/s", "XLA temporaries (MiB)"], rows)


def remat_table() -> str:
  import jax

  from benchmarks import bench_step

  rows = []
  # Unrolled layers on XLA:CPU keep the same peak with remat (its scheduler runs the recomputed
  # forward early); under lax.scan each backward iteration recomputes its own block.
  for scan in (False, True):
    for remat in ("none", "block", "full"):
      run_config = _run_config(
        **{
          "data.seq_len": FLAGS.remat_length,
          "model.remat": remat,
          "model.attention_impl": FLAGS.remat_attention_impl,
          "model.scan_layers": scan,
        }
      )
      memory = bench_step.compile_train_step(run_config, jax.devices())
      temp = f"{memory['temp_bytes'] / MIB:,.0f}"
      rows.append([FLAGS.remat_length, FLAGS.remat_attention_impl, scan, remat, temp])
  header = ["length", "attention", "scan_layers", "remat", "XLA temporaries (MiB)"]
  return _table(header, rows)


def compile_table() -> str:
  import jax

  from benchmarks import bench_step

  rows = []
  for scan in (False, True):
    run_config = _run_config(**{"data.seq_len": 256, "model.num_layers": FLAGS.deep_layers,
                        "model.scan_layers": scan})  # fmt: skip
    result = bench_step.compile_train_step(run_config, jax.devices())
    rows.append([FLAGS.deep_layers, scan, f"{result['compile_seconds']:.1f}"])
  return _table(["layers", "scan_layers", "compile (s)"], rows)


TABLES = {"attention": attention_table, "remat": remat_table, "compile": compile_table}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  unknown = [t for t in FLAGS.tables if t not in TABLES]
  if unknown:
    print(f"train_memory.py: error: --tables: {unknown} not in {list(TABLES)}", file=sys.stderr)
    sys.exit(1)
  from roformer.infra import cpu_flags

  cpu_flags.set_default_cpu_flags()  # as train.py does, before JAX starts
  for name in FLAGS.tables:
    print(f"\n{name}\n{TABLES[name]()}", flush=True)


if __name__ == "__main__":
  app.run(main)
