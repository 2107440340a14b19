"""Perplexity against context length for a trained run, or several runs in one plot.

This file is intentionally kept short; the logic lives in roformer/eval_run.py and eval_lib.py.

  python eval.py --workdir=DIR [--lengths=256,512] [--protocol=both] [--rope_scaling=yarn ...]
  python eval.py --compare=DIR1,DIR2 --plot=FILE.png
"""

import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory to evaluate (its config.json and checkpoints).")
flags.DEFINE_list("lengths", [], "Window lengths; default: training length to 16x, powers of 2.")
flags.DEFINE_enum("protocol", "both", ["nonoverlapping", "sliding", "both"], "Window protocol.")
flags.DEFINE_integer("stride", 0, "Sliding-window stride; 0 = length / 4.")
flags.DEFINE_integer("max_tokens", 65536, "Scored tokens per length (multiple of the largest).")
flags.DEFINE_enum("split", "validation", ["validation", "test"], "Split of the run's corpus.")
flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
flags.DEFINE_integer("batch_size", 0, "Windows per batch; 0 = about 16k tokens per batch.")
flags.DEFINE_string("rope_scaling", "none", "RoPE scaling applied at evaluation (RoPE runs).")
flags.DEFINE_float("rope_factor", 1.0, "Factor of --rope_scaling.")
flags.DEFINE_string("data_files", "", "Glob of other text, tokenized with the run's tokenizer.")
flags.DEFINE_string("out", "", "NAME of DIR/eval/NAME.json|png (or of the JSON --compare reads).")
flags.DEFINE_list("compare", [], "Workdirs (or eval JSON files) to draw in one plot.")
flags.DEFINE_string("plot", "", "Output PNG of --compare.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Orbax and absl log every checkpoint read at INFO; keep the output to progress lines.
  logging.set_verbosity(logging.WARNING)
  try:
    if FLAGS.compare:
      from roformer import eval_plot  # plotting only: no JAX needed

      if not FLAGS.plot:
        raise ValueError("--compare needs --plot=FILE.png")
      path = eval_plot.compare_runs(
        FLAGS.compare, FLAGS.plot, name=FLAGS.out or eval_plot.DEFAULT_NAME
      )
      print(f"wrote {path}")
      return
    if not FLAGS.workdir:
      raise ValueError("give --workdir=DIR (or --compare=DIR1,DIR2 --plot=FILE.png)")
    from roformer import cpu_flags

    cpu_flags.set_default_cpu_flags()  # before JAX starts
    import jax

    from roformer import eval_run

    print(f"JAX devices: {jax.devices()}", flush=True)
    if not all(x.strip().isdigit() for x in FLAGS.lengths):
      raise ValueError(f"--lengths must be positive integers, got {','.join(FLAGS.lengths)}")
    eval_run.evaluate_workdir(
      FLAGS.workdir,
      lengths=[int(x) for x in FLAGS.lengths],
      protocol=FLAGS.protocol,
      stride=FLAGS.stride,
      max_tokens=FLAGS.max_tokens,
      split=FLAGS.split,
      step=FLAGS.step,
      batch_size=FLAGS.batch_size,
      rope_scaling=FLAGS.rope_scaling,
      rope_factor=FLAGS.rope_factor,
      data_files=FLAGS.data_files,
      out=FLAGS.out,
      log=lambda line: print(line, flush=True),
    )
  except (ValueError, FileNotFoundError) as e:
    # Bad input (config, data, missing checkpoint) is one clear line and exit 1, no traceback.
    sys.exit(f"eval.py: error: {e}")


if __name__ == "__main__":
  app.run(main)
