"""Continues a prompt with a trained decoder run or an imported Hugging Face decoder, printing
the continuation.

The logic lives in roformer/generate.py.

  python generate.py --workdir=DIR --prompt="def main(" [--max_new_tokens=64 --temperature=0.8
    --top_k=40 --top_p=0.95 --seed=0 --rope_scaling=KIND --rope_factor=F --step=N
    --extend=KIND --extend_*=N]   # e.g. --extend=sinks --extend_sinks=4 --extend_window=1020
  python generate.py --hf_model=HF_DIR --prompt=TEXT [the same flags but --step]
"""

import sys

from absl import app, flags, logging

from roformer.evals import extend_flags
from roformer.infra import compile_cache

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory (its config.json, checkpoints, tokenizer).")
flags.DEFINE_string(
  "hf_model",
  "",
  "A Hugging Face Llama/Mistral/Qwen2/GPT-NeoX directory (config.json, safetensors, "
  "tokenizer.json) that generates instead of a run; its max_position_embeddings is the training "
  "length (the original length of --rope_scaling).",
)
flags.DEFINE_string("prompt", None, "Text to continue.")
flags.DEFINE_integer("max_new_tokens", 64, "Number of tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = all.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: smallest set of tokens reaching p; 1 = all.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("rope_scaling", "none", "RoPE scaling applied at generation (RoPE runs).")
flags.DEFINE_float("rope_factor", 1.0, "Factor of --rope_scaling.")
flags.DEFINE_integer("step", None, "Checkpoint step of --workdir; default the latest.")
extend_flags.define_flags()
compile_cache.define_flags()


def _check_flag_combinations() -> None:
  """One model source and a prompt; a flag the chosen source does not read is an error naming
  it, never ignored."""
  given = lambda name: FLAGS[name].present  # noqa: E731
  if bool(FLAGS.workdir) == bool(FLAGS.hf_model):
    raise ValueError(
      "give --workdir=DIR (a run) or --hf_model=HF_DIR (a Hugging Face decoder), one of them"
    )
  if FLAGS.prompt is None:
    raise ValueError("give --prompt=TEXT")
  for name in ("top_k", "top_p", "seed"):
    if given(name) and FLAGS.temperature == 0.0:
      raise ValueError(f"--{name} applies to sampling; it is not read at --temperature=0 (greedy)")
  if given("rope_factor") and FLAGS.rope_scaling == "none":
    raise ValueError(f"--rope_factor={FLAGS.rope_factor} needs --rope_scaling=KIND")
  if FLAGS.hf_model and given("step"):
    raise ValueError("--step is not read with --hf_model (one set of weights, no checkpoints)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  try:
    _check_flag_combinations()
    from roformer.infra import cpu_flags

    cpu_flags.set_default_cpu_flags()  # before JAX starts
    from roformer import generate
    from roformer.data.sources.base import cache_root
    from roformer.evals.spec import extension_from_options

    compile_cache.enable_from_flags(FLAGS, cache_root())  # before any compile

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
      hf_model=FLAGS.hf_model,
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
