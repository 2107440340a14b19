"""A/B of two train steps in one process, one step of each in turn: changes of a few percent,
measurable on a machine whose speed drifts by more than that between runs.

Step A is the train step as the tree has it (bench_step.JaxTrainer, jitted as train.py jits it).
Step B is the same step traced after `--variant`'s `apply()` (a Python file; `apply()` patches
the code and returns a function that undoes the patch) and compiled with the file's
`compiler_options` dict, if any (XLA options by name, e.g.
{"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}). The steps then run in
pairs, A B, B A, A B, ... so drift hits both alike, and the table gives the median of the pairs'
speed ratios B / A with its quartiles.

  JAX_PLATFORMS=cpu python -m benchmarks.ab_step --variant=my_variant.py --pairs=50 \
    --config=configs/lm.py --config.model.num_layers=4 ...
  JAX_PLATFORMS=cpu python -m benchmarks.ab_step --smoke --variant=F   # seconds; the test's
"""

import importlib.util
import json
import os
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

from benchmarks import bench_step

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

config_flags.DEFINE_config_file(
  "config", os.path.join(_REPO, "configs", "lm.py"), "Training config file.", lock_config=True
)
flags.DEFINE_string("variant", None, "Python file with apply() and/or compiler_options.")
flags.DEFINE_integer("pairs", 40, "Timed pairs of steps (one of each).")
flags.DEFINE_bool("smoke", False, "Tiny model and 4 pairs, --pairs aside (a test runs this).")
flags.DEFINE_string("json", "", "Write the result to this JSON file.")
flags.mark_flag_as_required("variant")
FLAGS = flags.FLAGS


def load_variant(path: str):
  """The variant module at `path`; exits with a message if it defines neither hook."""
  if not os.path.isfile(path):
    sys.exit(f"ab_step.py: error: --variant={path} is not a file")
  spec = importlib.util.spec_from_file_location("ab_step_variant", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "apply") and not hasattr(module, "compiler_options"):
    sys.exit(f"ab_step.py: error: {path} defines neither apply() nor compiler_options")
  return module


def variant_trainer(run_config, variant):
  """bench_step.JaxTrainer traced under the variant's patch, compiled with its options."""
  import jax

  undo = variant.apply() if hasattr(variant, "apply") else None
  options = getattr(variant, "compiler_options", None)
  compile_ = jax.stages.Lowered.compile
  if options:
    jax.stages.Lowered.compile = lambda self, *args, **kwargs: compile_(
      self, *args, **{**kwargs, "compiler_options": options}
    )
  try:
    return bench_step.JaxTrainer(run_config)
  finally:
    jax.stages.Lowered.compile = compile_
    if undo is not None:
      undo()


def ab(run_config, variant, pairs: int) -> dict:
  """Alternates one step of A and one of B `pairs` times; returns the speeds and ratios."""
  trainer_a = bench_step.JaxTrainer(run_config)
  trainer_b = variant_trainer(run_config, variant)
  for trainer in (trainer_a, trainer_b):
    trainer.run(2)  # warm-up
  seconds_a, seconds_b = [], []
  for i in range(pairs):
    order = (trainer_a, trainer_b) if i % 2 == 0 else (trainer_b, trainer_a)
    first, second = order[0].run(1), order[1].run(1)
    seconds_a.append(first if order[0] is trainer_a else second)
    seconds_b.append(second if order[0] is trainer_a else first)
    print(f"pair {i + 1}/{pairs}", end="\r", file=sys.stderr)
  print(file=sys.stderr)
  tokens = run_config.train.global_batch_size * run_config.data.seq_len
  ratios = [a / b for a, b in zip(seconds_a, seconds_b, strict=True)]
  low, _, high = (
    statistics.quantiles(ratios, n=4, method="inclusive") if pairs > 1 else (ratios[0],) * 3
  )
  return {
    "pairs": pairs,
    "tokens_per_sec_a": tokens / statistics.median(seconds_a),
    "tokens_per_sec_b": tokens / statistics.median(seconds_b),
    "speed_ratio_median": statistics.median(ratios),
    "speed_ratio_quartiles": [low, high],
  }


def main(argv):
  del argv
  if FLAGS.smoke:
    bench_step.apply_overrides(FLAGS.config, bench_step.SMOKE_MODEL)
  run_config_ = bench_step.run_config_or_exit("ab_step.py", FLAGS.config)
  if FLAGS.pairs < 1:
    sys.exit("ab_step.py: error: --pairs must be at least 1")
  result = ab(run_config_, load_variant(FLAGS.variant), 4 if FLAGS.smoke else FLAGS.pairs)
  low, high = result["speed_ratio_quartiles"]
  print("| | tokens/s (median of steps) |")
  print("|---|---|")
  print(f"| A (this tree) | {result['tokens_per_sec_a']:,.0f} |")
  print(f"| B ({os.path.basename(FLAGS.variant)}) | {result['tokens_per_sec_b']:,.0f} |")
  print(
    f"\nB / A speed, median of {result['pairs']} pairs: {result['speed_ratio_median']:.3f} "
    f"(quartiles {low:.3f}-{high:.3f})"
  )
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
