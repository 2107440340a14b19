"""What each 2024-26 option costs: train-step throughput of every arm against plain RoPE.

Builds the train step exactly as train.py does (bench_step.JaxTrainer) for plain RoPE and for each
2024-26 arm (configs/arms.py FRONTIER: iRoPE, RNoPE-SWA, QK-norm, SSMax, PoPE, Resonance RoPE, FoX,
attention sinks, the hybrids with the extrapolation grid's layers), each on the config's model and
batch with the arm's overrides on top, and times them round-robin (every repeat runs every arm, so
all see the same machine load). Prints one table: tokens/s (median over repeats) and the ratio to
plain RoPE. Use an idle machine: every arm uses every core.

  JAX_PLATFORMS=cpu python -m benchmarks.frontier            # the grid's cpu model, L = 128
  JAX_PLATFORMS=cpu python -m benchmarks.frontier --config.data.seq_len=512 \
      --config.train.global_batch_size=4                     # longer rows, same tokens per step
  JAX_PLATFORMS=cpu python -m benchmarks.frontier --smoke    # seconds; what the test runs
"""

import json
import os
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

from benchmarks import bench_step
from configs import arms
from experiments import extrapolation

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

config_flags.DEFINE_config_file(
  "config", os.path.join(_REPO, "configs", "lm.py"), "Training config file.", lock_config=True
)
FLAGS = flags.FLAGS
flags.DEFINE_list("only", [], "Arms to time beside plain RoPE (default: every arm).")
flags.DEFINE_integer("steps", 5, "Train steps per timed repeat.")
flags.DEFINE_integer("repeats", 5, "Timed repeats per arm (median reported).")
flags.DEFINE_integer("warmup", 2, "Untimed steps per arm after compiling.")
flags.DEFINE_string("json", "", "Also write the results to this JSON file.")
flags.DEFINE_bool("smoke", False, "A 1-layer, 32-wide model on 2 x 32 tokens (CI).")

# The extrapolation grid's cpu model (experiments/extrapolation.py SCALES["cpu"]).
GRID_MODEL = {
  "model.num_layers": 3,
  "model.emb_dim": 128,
  "model.num_heads": 4,
  "model.mlp_dim": 512,
  "model.embed_scale": "sqrt_d",
  "model.dropout_rate": 0.0,
  "data.tokenizer": "bytes",
  "data.seq_len": 128,
  "train.global_batch_size": 16,
}
SMOKE = {**GRID_MODEL, **bench_step.SMOKE_MODEL}


def arm_configs(config, only: list[str]) -> dict:
  """{arm: ConfigDict}: plain RoPE first, then each frontier arm on the same model and batch."""
  unknown = sorted(set(only) - set(arms.FRONTIER))
  if unknown:
    raise ValueError(f"--only: unknown arms {unknown}; choose from {arms.FRONTIER}")
  chosen = {"rope": {"posenc.kind": "rope"}}
  seq_len, nope_every = config.data.seq_len, extrapolation.NOPE_EVERY  # the grid's hybrids
  for name in arms.FRONTIER:
    if not only or name in only:
      chosen[name] = arms.overrides(name, seq_len=seq_len, nope_every=nope_every)
  configs = {}
  for name, overrides in chosen.items():
    arm_config = config.copy_and_resolve_references()
    bench_step.apply_overrides(arm_config, overrides)
    configs[name] = arm_config
  return configs


def benchmark(configs: dict, *, steps: int, repeats: int, warmup: int) -> list[dict]:
  trainers = {}
  for name, config in configs.items():
    print(f"compiling {name} ...", flush=True)
    trainers[name] = bench_step.JaxTrainer(bench_step.run_config_or_exit("frontier.py", config))
    trainers[name].run(warmup)
  seconds = {name: [] for name in trainers}
  for i in range(repeats):
    print(f"repeat {i + 1}/{repeats}", flush=True)
    for name, trainer in trainers.items():
      seconds[name].append(trainer.run(steps))
  rows = []
  for name, trainer in trainers.items():
    rc = trainer.run_config
    tokens = rc.train.global_batch_size * rc.data.seq_len * steps
    rows.append(
      {
        "arm": name,
        "tokens_per_sec": tokens / statistics.median(seconds[name]),
        "tokens_per_sec_runs": [tokens / s for s in seconds[name]],
        "compile_seconds": trainer.compile_seconds,
      }
    )
  base = rows[0]["tokens_per_sec"]
  for row in rows:
    row["ratio_to_rope"] = row["tokens_per_sec"] / base
  return rows


def format_table(rows: list[dict], shape: str) -> str:
  lines = [
    f"train step, {shape}",
    "",
    "| arm | tokens/s (median) | / plain RoPE | compile (s) |",
    "|---|---|---|---|",
  ]
  for row in rows:
    lines.append(
      f"| {row['arm']} | {row['tokens_per_sec']:,.0f} | {row['ratio_to_rope']:.2f} | "
      f"{row['compile_seconds']:.1f} |"
    )
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = FLAGS.config
  steps, repeats, warmup = FLAGS.steps, FLAGS.repeats, FLAGS.warmup
  # The grid's model unless the command line sets a field (the flags win over these defaults).
  given = {a.split("=")[0].removeprefix("--config.") for a in sys.argv if a.startswith("--config.")}
  defaults = SMOKE if FLAGS.smoke else GRID_MODEL
  bench_step.apply_overrides(config, {k: v for k, v in defaults.items() if k not in given})
  if FLAGS.smoke:
    steps, repeats, warmup = 1, 1, 1
  try:
    configs = arm_configs(config, FLAGS.only)
  except ValueError as e:
    print(f"frontier.py: error: {e}", file=sys.stderr)
    sys.exit(1)
  rows = benchmark(configs, steps=steps, repeats=repeats, warmup=warmup)
  m = config.model
  shape = (
    f"{m.num_layers}x{m.emb_dim} H{m.num_heads} F{m.mlp_dim}, "
    f"B{config.train.global_batch_size} x L{config.data.seq_len}, {m.dtype}"
  )
  print(format_table(rows, shape))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"shape": shape, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
