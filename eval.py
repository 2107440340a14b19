"""Perplexity against context length for a trained run, or several runs in one plot.

The logic lives in roformer/evals/ (ppl_vs_length.py, task_vs_length.py, perplexity.py).

  python eval.py --workdir=DIR [--lengths=256,512] [--protocol=both] [--rope_scaling=yarn ...]
  python eval.py --workdir=DIR --extend=self_extend --extend_window=64 --extend_group=4
  python eval.py --workdir=DIR --query_scale=logn   # a query temperature beyond the training length
  python eval.py --workdir=DIR --key_tokens [--key_short_window=K]   # + key-token ppl (LongPPL)
  python eval.py --workdir=DIR --out_dir=OUT   # results in OUT/ instead of DIR/eval/
  python eval.py --hf_model=HF_DIR --out_dir=OUT [--lengths=...]   # a Hugging Face causal LM
  python eval.py --compare=DIR1,DIR2 --plot=FILE.png   # workdirs, --out_dir directories, JSONs
  python eval.py --workdir=DIR --task_lengths=8,32,256   # synthetic-task runs: accuracy vs length
  python eval.py --workdir=DIR --task_lengths=default --effective_threshold=0.856  # RULER's limit
  python eval.py --workdir=DIR --task_lengths=default --extend=dca --extend_chunk=96  # + extension
  python eval.py --compare=DIR1,DIR2 --plot=FILE.png --out=task_vs_length
"""

import os
import sys

from absl import app, flags, logging

from roformer.evals import extend_flags
from roformer.infra import compile_cache

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory to evaluate (its config.json and checkpoints).")
flags.DEFINE_string(
  "hf_model",
  "",
  "A Hugging Face Llama/Mistral/Qwen2/GPT-NeoX directory (config.json, safetensors, "
  "tokenizer.json) evaluated instead of a run; its max_position_embeddings is the training "
  "length. Needs --out_dir: nothing is written into HF_DIR.",
)
flags.DEFINE_string(
  "out_dir",
  "",
  "Directory of the results (NAME.json, NAME.png) instead of DIR/eval/, e.g. for a read-only "
  "workdir; needed with --hf_model. Checked writable before any work.",
)
flags.DEFINE_list("lengths", [], "Window lengths; default: training length to 16x, powers of 2.")
flags.DEFINE_enum("protocol", "both", ["nonoverlapping", "sliding", "both"], "Window protocol.")
flags.DEFINE_integer("stride", 0, "Sliding-window stride; 0 = length / 4.")
flags.DEFINE_integer(
  "max_tokens",
  65536,
  "Scored tokens per length, rounded down to a multiple of the longest length (said when it is); "
  "a value other than 65536 is part of the output name (_tok<N>).",
)
flags.DEFINE_enum("split", "validation", ["validation", "test"], "Split of the run's corpus.")
flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
flags.DEFINE_integer("batch_size", 0, "Windows per batch; 0 = about 16k tokens per batch.")
flags.DEFINE_string(
  "rope_scaling",
  "none",
  "RoPE scaling applied at evaluation (RoPE runs); it replaces an imported model's own.",
)
flags.DEFINE_string(
  "rope_factor", "1", "Factor of --rope_scaling, or 'auto' = each length / training length."
)
flags.DEFINE_float(
  "rope_beta_fast", 0.0, "--rope_scaling=yarn|ntk_by_parts: beta_fast (0 = posenc.scaling's 32)."
)
flags.DEFINE_float(
  "rope_beta_slow", 0.0, "--rope_scaling=yarn|ntk_by_parts: beta_slow (0 = posenc.scaling's 1)."
)
flags.DEFINE_string(
  "rope_ramp",
  "trained",
  "--rope_scaling=yarn|ntk_by_parts: count beta_fast / beta_slow rotations over the training "
  "length ('trained': Hugging Face, the YaRN paper) or over each evaluated length ('evaluated': "
  "Resonance RoPE's from-scratch code).",
)
flags.DEFINE_integer(
  "window", 0, "Sliding attention window imposed at evaluation (0 = as trained)."
)
flags.DEFINE_bool(
  "bca", False, "Blockwise causal attention (xPos): blocks of --window or the training length."
)
extend_flags.define_flags()
compile_cache.define_flags()
flags.DEFINE_enum(
  "query_scale",
  "none",
  ["none", "logn", "llama4"],
  "A query temperature imposed on a decoder run: logn = log_L(n) beyond the training length L "
  "(Qwen), llama4 = 1 + 0.1 ln(floor(n / L) + 1) (Llama 4 with floor_scale L).",
)
flags.DEFINE_string("data_files", "", "Glob of other text, tokenized with the run's tokenizer.")
flags.DEFINE_string("out", "", "NAME of DIR/eval/NAME.json|png (or of the JSON --compare reads).")
flags.DEFINE_multi_string(
  "compare",
  [],
  "Workdirs, --out_dir directories or eval JSON files to draw in one plot, comma-separated (a "
  "path that holds a comma is kept whole when it exists); repeatable.",
)
flags.DEFINE_string("plot", "", "Output PNG of --compare.")
flags.DEFINE_bool("overwrite", False, "Replace an existing DIR/eval/NAME.json and NAME.png.")
flags.DEFINE_list(
  "task_lengths",
  [],
  "Synthetic-task runs: task lengths to score (exact match, per token); "
  "'default' = the training range to 8x.",
)
flags.DEFINE_integer("task_examples", 128, "Examples per task length (and per passkey depth).")
flags.DEFINE_float(
  "effective_fraction",
  0.9,
  "Effective length (RULER's reading: the last length before the first one under the limit, "
  "from the training length up) against this fraction of the score at the training length; for "
  "perplexity, the loss may rise -ln(fraction) nats (0.105 for 0.9).",
)
flags.DEFINE_float(
  "effective_threshold",
  0.0,
  "An absolute limit of the effective length instead of --effective_fraction: the least task "
  "score with --task_lengths (RULER: 0.856), the largest perplexity otherwise; 0 = the fraction.",
)
flags.DEFINE_bool(
  "key_tokens",
  False,
  "Add each non-overlapping length's key-token perplexity (LongPPL: targets whose loss drops by "
  "> 2 nats from a short window to the whole window and is < 2 nats there), scored by the run's "
  "own model in both passes; writes NAME_keytok<K>.",
)
flags.DEFINE_integer(
  "key_short_window",
  0,
  "--key_tokens: tokens of the short pass's window (K; chunks of K // 4 targets share one); "
  "0 = a quarter of the training length.",
)
flags.DEFINE_integer(
  "position_draws",
  4,
  "Runs trained with randomized positions: draws of sorted random positions averaged over "
  "(each sequence takes a fresh subset of [0, posenc.randomize_max), as in training).",
)

# Flags that only evaluating one --workdir reads (an error with --compare).
WORKDIR_FLAGS = (
  "workdir", "hf_model", "out_dir", "lengths", "protocol", "stride", "max_tokens", "split", "step",
  "batch_size", "rope_scaling", "rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_ramp",
  "window", "bca", "query_scale", "data_files",
  "overwrite", "task_lengths", "task_examples", "position_draws", "effective_fraction",
  "effective_threshold", "key_tokens", "key_short_window", *extend_flags.NAMES,
)  # fmt: skip
# --overwrite is read by both modes: --workdir's JSON and PNG, --compare's --plot.
# Flags of perplexity evaluation that --task_lengths does not read (an error with it).
PERPLEXITY_FLAGS = (
  "lengths", "protocol", "stride", "max_tokens", "split", "data_files", "bca", "key_tokens",
  "key_short_window",
)  # fmt: skip


def _rope_options() -> dict:
  """The RoPE scaling flags as `spec_from_options` takes them."""
  return dict(
    rope_scaling=FLAGS.rope_scaling, rope_factor=FLAGS.rope_factor,
    rope_beta_fast=FLAGS.rope_beta_fast, rope_beta_slow=FLAGS.rope_beta_slow,
    rope_ramp=FLAGS.rope_ramp,
  )  # fmt: skip


def _check_flag_combinations() -> None:
  """A flag that the chosen mode does not read is an error naming both flags, never ignored."""
  given = lambda name: FLAGS[name].present  # noqa: E731
  if FLAGS.compare:
    for name in (n for n in WORKDIR_FLAGS if n != "overwrite"):
      if given(name):
        raise ValueError(
          f"--{name} is not read by --compare (which draws existing DIR/eval/NAME.json files); "
          "evaluate each run with --workdir first"
        )
    return
  if given("plot"):
    raise ValueError("--plot needs --compare=DIR1,DIR2,...; --workdir writes DIR/eval/NAME.png")
  if given("rope_factor") and FLAGS.rope_scaling == "none":
    raise ValueError(f"--rope_factor={FLAGS.rope_factor} needs --rope_scaling=KIND")
  if given("stride") and FLAGS.protocol == "nonoverlapping":
    raise ValueError("--stride sets sliding windows; it is not read with --protocol=nonoverlapping")
  if given("effective_fraction") and given("effective_threshold"):
    raise ValueError(
      "--effective_threshold replaces --effective_fraction with an absolute limit; give one"
    )
  if FLAGS.task_lengths:
    for name in PERPLEXITY_FLAGS:
      if given(name):
        raise ValueError(f"--{name} applies to perplexity evaluation, not --task_lengths")
  for name in ("lengths", "task_lengths"):
    if given(name) and not FLAGS[name].value:
      raise ValueError(
        f"--{name} is empty: give lengths (--{name}=256,512), or leave it out for the defaults"
      )
  if FLAGS.hf_model:
    for name in ("step", "task_lengths"):
      if given(name):
        raise ValueError(
          f"--{name} is not read with --hf_model (one set of weights, perplexity evaluation)"
        )
    if FLAGS.workdir is not None:
      raise ValueError(
        "--workdir names a training run; --hf_model evaluates HF_DIR instead: give "
        "--out_dir=DIR for its results"
      )
    if not FLAGS.out_dir:
      raise ValueError(
        "--hf_model needs --out_dir=DIR for its results (nothing is written into the model's "
        "directory)"
      )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Orbax and absl log every checkpoint read at INFO; keep the output to progress lines.
  logging.set_verbosity(logging.WARNING)
  try:
    _check_flag_combinations()
    if FLAGS.compare:
      from roformer.evals import plots  # plotting only: no JAX needed

      if not FLAGS.plot:
        raise ValueError("--compare needs --plot=FILE.png")
      if os.path.exists(FLAGS.plot) and not FLAGS.overwrite:
        raise FileExistsError(f"--plot={FLAGS.plot} exists; pass --overwrite to replace it")
      sources = plots.split_sources(FLAGS.compare)
      if FLAGS.out.startswith("task"):  # task_vs_length JSON: accuracy curves
        from roformer.evals import task_plots

        path = task_plots.compare_runs(sources, FLAGS.plot, name=FLAGS.out)
      else:
        path = plots.compare_runs(sources, FLAGS.plot, name=FLAGS.out or plots.DEFAULT_NAME)
      print(f"wrote {path}")
      return
    if FLAGS.workdir is None and not FLAGS.hf_model:
      raise ValueError(
        "give --workdir=DIR or --hf_model=HF_DIR (or --compare=DIR1,DIR2 --plot=FILE.png)"
      )
    from roformer.infra import cpu_flags

    cpu_flags.set_default_cpu_flags()  # before JAX starts
    import jax

    from roformer.data.sources.base import cache_root
    from roformer.evals import ppl_vs_length
    from roformer.evals import spec as spec_lib

    compile_cache.enable_from_flags(FLAGS, cache_root())  # before any compile

    print(f"JAX devices: {jax.devices()}", flush=True)
    from roformer.evals.effective_length import EffectiveRule

    effective = EffectiveRule(FLAGS.effective_fraction, FLAGS.effective_threshold)
    if FLAGS.task_lengths:
      from roformer.evals import task_vs_length

      lengths = [] if FLAGS.task_lengths == ["default"] else FLAGS.task_lengths
      if not all(x.strip().isdigit() for x in lengths):
        raise ValueError(f"--task_lengths must be positive integers or 'default', got {lengths}")
      # The model overrides of perplexity evaluation, checked and parsed the same way.
      overrides = spec_lib.spec_from_options(
        **_rope_options(),
        attention_window=FLAGS.window,
        query_scale=FLAGS.query_scale,
        extend=extend_flags.values(FLAGS)[0],
        extend_fields=extend_flags.values(FLAGS)[1],
      )
      task_vs_length.evaluate_tasks(
        FLAGS.workdir,
        lengths=[int(x) for x in lengths],
        num_examples=FLAGS.task_examples,
        batch_size=FLAGS.batch_size,
        step=FLAGS.step,
        out=FLAGS.out,
        position_draws=FLAGS.position_draws,
        effective=effective,
        rope=overrides.rope,
        window=overrides.window,
        extension=overrides.extension,
        query_scale=overrides.query_scale,
        log=lambda line: print(line, flush=True),
        out_dir=FLAGS.out_dir,
      )
      return
    if not all(x.strip().isdigit() for x in FLAGS.lengths):
      raise ValueError(f"--lengths must be positive integers, got {','.join(FLAGS.lengths)}")
    spec = spec_lib.spec_from_options(
      lengths=[int(x) for x in FLAGS.lengths],
      protocol=FLAGS.protocol,
      stride=FLAGS.stride,
      max_tokens=FLAGS.max_tokens,
      split=FLAGS.split,
      batch_size=FLAGS.batch_size,
      **_rope_options(),
      attention_window=FLAGS.window,
      bca=FLAGS.bca,
      query_scale=FLAGS.query_scale,
      extend=extend_flags.values(FLAGS)[0],
      extend_fields=extend_flags.values(FLAGS)[1],
      data_files=FLAGS.data_files,
      out=FLAGS.out,
      position_draws=FLAGS.position_draws,
      effective=effective,
      key_tokens=FLAGS.key_tokens,
      key_short_window=FLAGS.key_short_window,
    )
    ppl_vs_length.evaluate_workdir(
      FLAGS.workdir or "",
      spec,
      step=FLAGS.step,
      overwrite=FLAGS.overwrite,
      log=lambda line: print(line, flush=True),
      hf_model=FLAGS.hf_model,
      out_dir=FLAGS.out_dir,
    )
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    # Bad input (config, data, missing checkpoint) is one clear line and exit 1, no traceback.
    sys.exit(f"eval.py: error: {e}")
  except KeyboardInterrupt:
    # Results are written once all lengths are scored: an interrupted evaluation wrote nothing.
    print("eval.py: interrupted; no result written (DIR/eval/ is as before)", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  app.run(main)
