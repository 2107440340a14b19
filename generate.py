"""Continues a prompt with a trained decoder run, printing the continuation.

The logic lives in roformer/generate.py.

  python generate.py --workdir=DIR --prompt="def main(" [--max_new_tokens=64 --temperature=0.8
    --top_k=40 --top_p=0.95 --seed=0 --rope_scaling=KIND --rope_factor=F
    --extend=KIND --extend_*=N]   # e.g. --extend=sinks --extend_sinks=4 --extend_window=1020
"""

import sys

from absl import app, flags, logging

from roformer.evals import extend_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory (its config.json, checkpoints, tokenizer).")
flags.DEFINE_string("prompt", None, "Text to continue.")
flags.DEFINE_integer("max_new_tokens", 64, "Number of tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = all.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: smallest set of tokens reaching p; 1 = all.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("rope_scaling", "none", "RoPE scaling applied at generation (RoPE runs).")
flags.DEFINE_float("rope_factor", 1.0, "Factor of --rope_scaling.")
flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
extend_flags.define_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  try:
    if not FLAGS.workdir or FLAGS.prompt is None:
      raise ValueError("give --workdir=DIR and --prompt=TEXT")
    from roformer import generate
    from roformer.evals.spec import extension_from_options

    kind, fields = extend_flags.values(FLAGS)
    text = generate.generate_text(
      FLAGS.workdir,
      FLAGS.prompt,
      max_new_tokens=FLAGS.max_new_tokens,
      temperature=FLAGS.temperature,
      top_k=FLAGS.top_k,
      top_p=FLAGS.top_p,
      seed=FLAGS.seed,
      rope_scaling=FLAGS.rope_scaling,
      rope_factor=FLAGS.rope_factor,
      extension=extension_from_options(kind, **fields),
      step=FLAGS.step,
    )
    print(text, flush=True)
  except (ValueError, FileNotFoundError) as e:
    # Bad input is one clear line and exit 1, no traceback.
    sys.exit(f"generate.py: error: {e}")
  except KeyboardInterrupt:
    print("generate.py: interrupted", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  app.run(main)
