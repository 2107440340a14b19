"""Length generalisation on synthetic tasks: every encoding, with and without randomized positions.

Each run trains a small decoder on one task at one range of task lengths (roformer.train, in
process) and scores exact match and per-token accuracy from that range to 8x its longest length
(roformer.evals.task_vs_length; a run trained with randomized positions is scored at randomized
positions, as in training, averaged over `randomized_positions.EVAL_DRAWS` draws). Finished runs are
skipped, so an interrupted grid resumes where it stopped; a run is finished when its JSON holds the
run's full settings (grid.run_settings), and a JSON made with other settings stops the grid.

  python -m experiments.synthetic                                # the committed grid (cpu), hours
  python -m experiments.synthetic --scale=tiny                   # smoke grid into a temp dir
  python -m experiments.synthetic --only=copy/fire               # runs whose name matches
  python -m experiments.synthetic --only='copy/rope$'            # without +randomized

Writes OUT/<run>.json (the task evaluation, the run's settings and training time),
OUT/results.csv, OUT/<task>.png, OUT/passkey_heatmap__<run>.png (exact match by depth x length)
and OUT/table.md. Training workdirs go under --workdir_root (default: a directory of this OUT's
own under the cache, one workdir per run and settings).
"""

import csv
import dataclasses
import json
import os
import pathlib
import sys
import time

from absl import app, flags, logging

from configs import arms, default
from experiments import grid, progress, seeds

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The grid's flags, defined when it runs (`python -m experiments.synthetic`) and not on import:
  the results pages and the benchmarks import this module beside flags of their own."""
  flags.DEFINE_enum(
    "scale",
    "cpu",
    ["tiny", "cpu"],
    "Grid size (see SCALES); cpu is committed.",
    flag_values=flag_values,
  )
  flags.DEFINE_list(
    "only",
    [],
    "Run only the runs whose name contains one of these substrings; a trailing $ anchors the end "
    "(copy/rope$ is copy/rope without copy/rope+randomized).",
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "out",
    "",
    "Output directory; default results/synthetic (cpu) or a temp directory (tiny).",
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "workdir_root",
    "",
    "Where training workdirs go; default a directory of OUT's own in the cache.",
    flag_values=flag_values,
  )
  flags.DEFINE_bool(
    "adopt",
    False,
    "Record today's settings in run JSONs written before runs recorded them.",
    flag_values=flag_values,
  )
  flags.DEFINE_integer(
    "seeds",
    1,
    "Seeds per run: replicate k of a run is <run>-seed<k>, train.seed k (experiments/seeds.py).",
    lower_bound=1,
    flag_values=flag_values,
  )


# Every encoding of the registry, plus p-RoPE (configs/arms.py `prope`: RoPE with its lowest
# quarter of frequencies off).
CLASSIC = ("nope", "sinusoidal", "learned", "t5", "alibi", "rope", "prope", "xpos", "kerple",
           "fire", "sandwich", "cope")  # fmt: skip
# The 2024-26 options (docs/frontier.md), as configs/arms.py defines them (and
# experiments/extrapolation.py runs them). Two layers here, so the hybrids alternate a RoPE layer
# attending within data.seq_len / 4 with a NoPE layer attending to everything. Not randomized
# (their papers train at positions 0, 1, 2, ...).
FRONTIER = arms.FRONTIER
NOPE_EVERY = 2
ENCODINGS = (*CLASSIC, *FRONTIER)  # the arms trained from scratch, in grid order
# Arms made from another run of the same task rather than trained from scratch, as
# experiments/extrapolation.py makes them. DroPE (arXiv 2512.12167) continues the RoPE run with no
# positional encoding for a tenth of its steps; rope_continued continues it with RoPE for as many
# (the control: what the extra steps alone give). An evaluation arm scores a run with an option
# applied at evaluation only, no training: the query temperatures (`runs.eval_model_config`:
# logn = log_L(n), llama4 = 1 + 0.1 ln(floor(n / L) + 1), L = data.seq_len), and YaRN with the
# factor each length needs (Resonance YaRN on the Resonance run, plain YaRN on RoPE's).
RECALIBRATIONS = {  # name -> (the run it continues, its posenc.kind)
  name: (arms.ARMS[name].starts_from, arms.kind(name)) for name in arms.RECALIBRATIONS
}
RECALIBRATION_FRACTION = 0.1
EVALUATIONS = {  # name -> (the run scored, its evaluation options)
  "rope_logn": ("rope", {"query_scale": "logn"}),
  "rope_llama4": ("rope", {"query_scale": "llama4"}),
  "drope_logn": ("drope", {"query_scale": "logn"}),
  "rope_yarn": ("rope", {"rope_scaling": "yarn", "rope_factor": "auto"}),
  "resonance_yarn": ("resonance", {"rope_scaling": "yarn", "rope_factor": "auto"}),
  # The same, with YaRN as the Resonance RoPE authors' from-scratch code (PosGen) runs it.
  "rope_yarn_authors": ("rope", grid.YARN_AUTHORS),
  "resonance_yarn_authors": ("resonance", grid.YARN_AUTHORS),
}
DERIVED = {**RECALIBRATIONS, **EVALUATIONS}  # name -> (the run it starts from, how)


def _apply_arm(config, encoding: str) -> None:
  """Sets the encoding's fields at the config's data.seq_len: an arm of configs/arms.py, or a
  posenc.kind of its own."""
  if encoding in arms.ARMS:
    arms.apply(config, encoding, nope_every=NOPE_EVERY)
  else:
    config.posenc.kind = encoding


@dataclasses.dataclass(frozen=True)
class Scale:
  model: dict
  train: dict
  tasks: dict  # task -> (task_min_len, task_max_len)
  encodings: tuple
  randomize: tuple  # (False,), (True,) or both
  examples: int  # evaluation examples per length
  only_runs: tuple = ()  # if set: the (task, encoding, randomized) runs of a smoke grid


SCALES = {
  # A smoke test of the whole pipeline (CI): a few runs of a few steps, not a result.
  "tiny": Scale(
    model=dict(num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64),
    train=dict(global_batch_size=8, num_train_steps=20, learning_rate=3e-3),
    tasks={"copy": (2, 4), "associative_recall": (2, 4), "passkey": (8, 16)},
    encodings=("rope", "fire", "drope", "rope_logn"),
    randomize=(False, True),
    examples=8,
    # RoPE on every task; on copy the two derived kinds (a recalibration, an evaluation of a
    # run); on passkey an encoding trained and scored at randomized positions (its heatmap).
    only_runs=(
      ("copy", "rope", False),
      ("copy", "drope", False),
      ("copy", "rope_logn", False),
      ("associative_recall", "rope", False),
      ("passkey", "rope", False),
      ("passkey", "fire", True),
    ),  # fmt: skip
  ),
  # The comparison: 3 tasks x (12 encodings + the 10 that read positions randomized + the 9
  # FRONTIER arms) = 93 runs of 2000 steps, and per task the DERIVED arms (two of 200 steps, five
  # evaluations only). Training ranges are short enough for a 2-layer model to learn in that budget
  # on CPU (copy at 8..32 is still at 0.40 per-token accuracy on its longest strings after 1200
  # such steps). Associative recall trains on 2..8 pairs: with this recipe RoPE retrieves after
  # about 1000 steps, while on 4..16 pairs at this learning rate it stays at the no-lookup
  # baseline for thousands of steps (docs/synthetic.md).
  "cpu": Scale(
    model=dict(num_layers=2, emb_dim=128, num_heads=4, mlp_dim=256),
    train=dict(global_batch_size=32, num_train_steps=2000, learning_rate=2e-3),
    tasks={"copy": (4, 16), "associative_recall": (2, 8), "passkey": (16, 64)},
    encodings=(*ENCODINGS, *DERIVED),
    randomize=(False, True),
    examples=128,
  ),
}


def run_name(task: str, encoding: str, randomized: bool, seed: int = 0) -> str:
  """`task/encoding[+randomized]`, and `-seed<k>` for seed replicate k (experiments/seeds.py)."""
  return seeds.replicate_name(f"{task}/{encoding}" + ("+randomized" if randomized else ""), seed)


def file_stem(name: str) -> str:
  """The run's name as a file name: its JSON is `<stem>.json`, its workdir `<stem>`."""
  return name.replace("/", "__")


def selected(name: str, only: list[str]) -> bool:
  """True if `name` contains one of `only` (an entry ending in $ must end `name`)."""
  return any(name.endswith(s[:-1]) if s.endswith("$") else s in name for s in only)


def grid_runs(scale: Scale) -> list[tuple[str, str, bool]]:
  """(task, encoding, randomized) of every run; no randomized run of an encoding without positions.

  NoPE and CoPE never read the token positions, so randomizing them would repeat the plain run.
  """
  from roformer import posenc

  runs = []
  for task in scale.tasks:
    for encoding in scale.encodings:
      if encoding in DERIVED:  # after the run it starts from (grid order)
        if not scale.only_runs or (task, encoding, False) in scale.only_runs:
          runs.append((task, encoding, False))
        continue
      kind = arms.kind(encoding) if encoding in arms.ARMS else encoding
      for randomized in scale.randomize:
        if scale.only_runs and (task, encoding, randomized) not in scale.only_runs:
          continue
        if randomized and (not posenc.POSENCS[kind].reads_positions or encoding in FRONTIER):
          continue
        runs.append((task, encoding, randomized))
  return runs


def make_config(
  scale: Scale, task: str, encoding: str, randomized: bool, seq_len_8x: int, seed: int = 0
):
  """The run's ConfigDict: configs/default.py with the scale's model and the task's lengths;
  train.seed `seed` (0: the committed runs)."""
  from roformer.data import synthetic

  lo, hi = scale.tasks[task]
  config = default.get_config()
  for field, value in scale.model.items():
    config.model[field] = value
  config.model.attention_impl = "auto"
  # One embedding scale for every encoding, as in the other grids: fairseq's N(0, 1/d) times
  # sqrt(d) also helps the encodings whose papers used BERT's table, so "auto" would favour some.
  config.model.embed_scale = "sqrt_d"
  config.model.attention_block = 128
  config.posenc.max_len = seq_len_8x  # learned: a row for every position evaluated
  if randomized:
    config.posenc.randomize_max = seq_len_8x
  config.data.source = "synthetic"
  config.data.task = task
  config.data.task_min_len, config.data.task_max_len = lo, hi
  config.data.seq_len = synthetic.example_length(task, hi) - 1
  _apply_arm(config, encoding)
  config.optim.learning_rate = scale.train["learning_rate"]
  config.optim.warmup_steps = max(1, scale.train["num_train_steps"] // 20)
  config.optim.weight_decay = 0.0
  config.train.global_batch_size = scale.train["global_batch_size"]
  config.train.num_train_steps = scale.train["num_train_steps"]
  config.train.log_every_steps = max(1, scale.train["num_train_steps"] // 5)
  config.train.eval_every_steps = 0
  config.train.eval_max_tokens = 0
  config.train.checkpoint_every_steps = 0
  config.train.seed = seed
  return config


def eval_spec(scale: Scale, task: str, randomized: bool, encoding: str = "") -> dict:
  """How a run is scored: task lengths, examples per length, draws of positions, and an
  evaluation arm's options."""
  from roformer.evals import task_vs_length
  from roformer.posenc import randomized as randomized_positions

  lo, hi = scale.tasks[task]
  spec = {
    "lengths": task_vs_length.default_task_lengths(lo, hi),
    "examples": scale.examples,
    "position_draws": randomized_positions.EVAL_DRAWS if randomized else 0,
  }
  if encoding in EVALUATIONS:
    spec.update(EVALUATIONS[encoding][1])
  return spec


def run_config(
  scale: Scale, task: str, encoding: str, randomized: bool, workroot=None, seed: int = 0
):
  """The run's ConfigDict (its learned table and randomized range reach 8x the training lengths).

  An evaluation arm's is the run it scores; a recalibration's starts from the workdir its
  run (of the same seed) has under `workroot` (required for those).
  """
  from roformer.data import synthetic

  if encoding in EVALUATIONS:
    return run_config(scale, task, EVALUATIONS[encoding][0], randomized, workroot, seed)
  if encoding in RECALIBRATIONS:
    parent = RECALIBRATIONS[encoding][0]
    config = run_config(scale, task, parent, randomized, workroot, seed)
    _apply_arm(config, encoding)  # its posenc.kind
    steps = max(1, round(scale.train["num_train_steps"] * RECALIBRATION_FRACTION))
    config.train.num_train_steps = steps
    config.optim.warmup_steps = max(1, steps // 10)
    config.train.log_every_steps = max(1, steps // 5)
    config.train.init_from = str(parent_workdir(scale, task, encoding, workroot, seed))
    return config
  lengths = eval_spec(scale, task, randomized)["lengths"]
  seq_len_8x = synthetic.example_length(task, max(lengths)) - 1
  return make_config(scale, task, encoding, randomized, seq_len_8x, seed)


def run_settings(
  scale: Scale, task: str, encoding: str, randomized: bool, workroot, seed: int = 0
) -> dict:
  """The settings a run's JSON records (`grid.run_settings`; paths relative to `workroot`)."""
  return grid.run_settings(
    run_config(scale, task, encoding, randomized, workroot, seed),
    eval_spec(scale, task, randomized, encoding),
    workroot=pathlib.Path(workroot),
  )


def run_workdir(scale: Scale, task: str, encoding: str, randomized: bool, workroot, seed: int = 0):
  """Where a run trains under `workroot` (an evaluation arm: the run it scores)."""
  if encoding in EVALUATIONS:
    return parent_workdir(scale, task, encoding, workroot, seed)
  settings = run_settings(scale, task, encoding, randomized, workroot, seed)
  name = file_stem(run_name(task, encoding, randomized, seed))
  return pathlib.Path(workroot) / grid.workdir_name(name, settings)


def parent_workdir(scale: Scale, task: str, encoding: str, workroot, seed: int = 0) -> pathlib.Path:
  if workroot is None:
    raise ValueError(f"{encoding} starts from another run: give the grid's workroot")
  return run_workdir(scale, task, DERIVED[encoding][0], False, workroot, seed)


def restore_parent(
  scale: Scale, task: str, encoding: str, workroot, out: pathlib.Path, seed: int = 0
) -> None:
  """Retrains the run a derived arm starts from if its workdir has no final checkpoint (workdirs
  live in a per-machine cache; the committed results hold no checkpoints)."""
  parent = DERIVED[encoding][0]
  if parent in DERIVED:
    restore_parent(scale, task, parent, workroot, out, seed)
  name = run_name(task, parent, False, seed)
  grid.restore_run(
    name,
    run_config(scale, task, parent, False, workroot, seed),
    parent_workdir(scale, task, encoding, workroot, seed),
    out / (file_stem(name) + ".json"),
  )


def run_overrides(config) -> dict:
  """The run's config as overrides of configs/default.py (dotted names): what its JSON records,
  so that `grid.make_config("", overrides)` (experiments/rerun.py) builds the config again."""
  defaults = grid.flat_fields(default.get_config())
  return {k: v for k, v in grid.flat_fields(config).items() if defaults.get(k, v) != v}


def score(workdir, spec: dict) -> dict:
  """The task evaluation `spec` (`eval_spec`) of the run in `workdir`; with an evaluation arm's
  options also the same checkpoint without them ("plain_records")."""
  from roformer.evals import task_vs_length
  from roformer.evals.spec import spec_from_options

  evaluate = lambda **options: task_vs_length.evaluate_tasks(  # noqa: E731
    workdir,
    lengths=spec["lengths"],
    num_examples=spec["examples"],
    position_draws=spec["position_draws"] or 1,
    log=lambda line: None,
    **options,
  )[0]
  # The arm's RoPE options (EVALUATIONS), parsed as eval.py parses its flags.
  rope = spec_from_options(**{k: v for k, v in spec.items() if k.startswith("rope_")}).rope
  result = evaluate(query_scale=spec.get("query_scale", "none"), rope=rope)
  if rope is not None or "query_scale" in spec:
    # The same checkpoint without the option: the arm's own baseline (a run retrained in
    # another environment may score a little differently from its recorded JSON).
    result["plain_records"] = evaluate()["records"]
  return result


def run_one(
  scale: Scale, task: str, encoding: str, randomized: bool, config, workdir, seed: int = 0
) -> dict:
  spec = eval_spec(scale, task, randomized, encoding)
  name = run_name(task, encoding, randomized, seed)
  start = time.perf_counter()
  if encoding not in EVALUATIONS:  # those score the run they start from as it is
    grid.train_to_end(name, config, pathlib.Path(workdir))
  train_seconds = time.perf_counter() - start
  result = score(workdir, spec)
  return {
    "run": name,
    "encoding": encoding,
    "randomized": randomized,
    "embed_scale": config.model.embed_scale,
    "train_seconds": round(train_seconds, 1),
    **result,
  }


def grid_order(result: dict) -> tuple:
  """Sort key of run results: the order of ENCODINGS, each without then with randomization."""
  names = [*ENCODINGS, *DERIVED]
  encoding = result["encoding"]
  return (names.index(encoding) if encoding in names else len(names), encoding,
          result["randomized"])  # fmt: skip


def write_summaries(out: str, results: list[dict], draw: bool = True) -> None:
  """results.csv, table.md and (unless not `draw`) the PNGs of each task from every run's JSON
  (seed replicates: in results.csv, with their seed, and in tables of their own)."""
  from roformer.evals import task_plots
  from roformer.evals.effective_length import (
    RULER_THRESHOLD,
    EffectiveRule,
    task_effective_lengths,
  )

  with open(os.path.join(out, "results.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(
      ["task", "encoding", "randomized", "length", "exact_match", "token_accuracy", "skipped",
       "seed"]
    )  # fmt: skip
    for r in results:
      for rec in r["records"]:
        writer.writerow(
          [r["task"], r["encoding"], r["randomized"], rec["length"], rec.get("exact_match", ""),
           rec.get("token_accuracy", ""), rec.get("skipped", ""), seeds.split_name(r["run"])[1]]
        )  # fmt: skip
  every_result, results = results, seeds.seed_zero(results)
  lines = [
    "# Synthetic tasks: accuracy against task length",
    "",
    "Randomized runs are scored at randomized positions as in training: the mean over "
    "draws of positions (each draw's scores are in the run's JSON).",
    "",
    "Effective n: the last length before the first one under 0.9 x the run's own score at its "
    "longest training length, read from that length up as RULER reads its effective length "
    "(eval.py's default; `64+`: no evaluated length under the limit; `-`: scoring 0 at the "
    "training length). The limit is relative to the run. RULER's n: the same reading against "
    "RULER's one absolute limit for every model, a score of 0.856 (eval.py "
    "--effective_threshold=0.856).",
    "",
  ]
  for task in dict.fromkeys(r["task"] for r in results):
    runs = sorted((r for r in results if r["task"] == task), key=grid_order)
    panels = [
      (title, [(r["encoding"], r) for r in runs if r["randomized"] == randomized])
      for title, randomized in (("positions 0, 1, 2, ...", False), ("randomized positions", True))
    ]
    lengths = sorted({rec["length"] for r in runs for rec in r["records"]})
    baseline = no_lookup_baseline(lengths) if task == "associative_recall" else None
    if draw:
      task_plots.plot_task_grid(
        [(title, panel) for title, panel in panels if panel],
        os.path.join(out, f"{task}.png"),
        title=f"{task}: accuracy against length",
        baseline=baseline,
      )
    for r in runs:
      if draw and "passkey_depths" in r:
        suffix = r["encoding"] + ("+randomized" if r["randomized"] else "")
        task_plots.plot_passkey_heatmap(r, os.path.join(out, f"passkey_heatmap__{suffix}.png"))
    lo, hi = runs[0]["train_lengths"]
    for metric, heading in task_plots.METRIC_LABELS.items():
      lines += [f"## {task}: {heading} (trained on lengths {lo}..{hi})", ""]
      lines.append(
        "| encoding | randomized | "
        + " | ".join(f"n={n}" for n in lengths)
        + " | effective n | RULER's n |"
      )
      lines.append("|---|---|" + "---|" * (len(lengths) + 2))
      for r in runs:
        by_length = {rec["length"]: rec for rec in r["records"]}
        cells = [
          "skip" if "skipped" in by_length.get(n, {"skipped": 1}) else f"{by_length[n][metric]:.2f}"
          for n in lengths
        ]
        for rule in (EffectiveRule(), EffectiveRule(threshold=RULER_THRESHOLD)):
          found = task_effective_lengths(r, rule)[metric]
          beyond = "+" if found["first_failing"] is None else ""  # no length under the limit
          cells.append("-" if found["length"] is None else f"{found['length']}{beyond}")
        lines.append(
          f"| {r['encoding']} | {'yes' if r['randomized'] else 'no'} | " + " | ".join(cells) + " |"
        )
      if baseline is not None:
        cells = [f"{v:.2f}" for v in baseline[metric]] + ["", ""]
        lines.append(f"| {baseline['label']} | | " + " | ".join(cells) + " |")
      lines.append("")
  scores = [
    {"task": r["task"], "run": r["run"], "length": rec["length"], "em": rec["exact_match"]}
    for r in every_result
    for rec in r["records"]
    if "exact_match" in rec
  ]
  tasks = dict.fromkeys(r["task"] for r in results)
  replicated = seeds.section(
    [(f"{t}, exact match", seeds.summary(scores, value="em", where={"task": t})) for t in tasks]
  )
  lines += [*replicated[1:], ""] if replicated else []
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write("\n".join(lines))


def no_lookup_baseline(lengths, examples: int = 512) -> dict:
  """Associative recall's predictor that never looks a key up, on the evaluation examples."""
  from roformer.data import synthetic
  from roformer.evals import task_vs_length

  scores = [
    synthetic.recall_without_lookup(
      task_vs_length.eval_examples("associative_recall", n, examples, seed=0)
    )
    for n in lengths
  ]
  return {
    "label": "no lookup",
    "lengths": list(lengths),
    "exact_match": [float(e) for e, _ in scores],
    "token_accuracy": [float(t) for _, t in scores],
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  scale = SCALES[FLAGS.scale]
  out = pathlib.Path(FLAGS.out) if FLAGS.out else None
  out = out or grid.default_out("synthetic", FLAGS.scale, grid.REPO / "results" / "synthetic")
  grid.check_out(out, FLAGS.scale)
  out.mkdir(parents=True, exist_ok=True)
  root = pathlib.Path(FLAGS.workdir_root or grid.default_workroot("synthetic", out))
  every_run = grid_runs(scale)
  runs = [r for r in every_run if not FLAGS.only or selected(run_name(*r), FLAGS.only)]
  if not runs:
    names = ", ".join(run_name(*r) for r in every_run[:4])
    raise app.UsageError(
      f"--only={','.join(FLAGS.only)} matches no run of the {FLAGS.scale} grid (runs are named "
      f"like {names}, ...)"
    )
  # Seed replicates after every seed-0 run, each seed in grid order (parents first).
  runs = [(*run, seed) for seed in range(FLAGS.seeds) for run in runs]
  print(f"synthetic grid, scale {FLAGS.scale}: {len(runs)} runs -> {out} (workdirs {root})")
  report = progress.ThrottledReport(summarize)
  with progress.stop_on_ctrl_c(out), report.flushed_on_error():
    for i, (task, encoding, randomized, seed) in enumerate(runs, start=1):
      name = run_name(task, encoding, randomized, seed)
      path = out / (file_stem(name) + ".json")
      config = run_config(scale, task, encoding, randomized, root, seed)
      settings = run_settings(scale, task, encoding, randomized, root, seed)
      if grid.finished_record(path, settings, adopt=FLAGS.adopt) is not None:
        print(f"[{i}/{len(runs)}] {name}: done before, skipped", flush=True)
        continue
      start = time.perf_counter()
      if encoding in DERIVED:
        restore_parent(scale, task, encoding, root, out, seed)
      workdir = run_workdir(scale, task, encoding, randomized, root, seed)
      result = run_one(scale, task, encoding, randomized, config, str(workdir), seed)
      result.update(base="", overrides=run_overrides(config))
      result.update(settings=settings, settings_hash=grid.settings_hash(settings))
      path.write_text(json.dumps(result, indent=2) + "\n")
      scored = [rec for rec in result["records"] if "skipped" not in rec]
      summary = ", ".join(
        f"n={rec['length']} {rec['exact_match']:.2f}/{rec['token_accuracy']:.2f}" for rec in scored
      )
      print(
        f"[{i}/{len(runs)}] {name}: {time.perf_counter() - start:.0f}s, exact match / per token "
        f"{summary}",
        flush=True,
      )
      report(str(out))  # a grid stopped part way leaves its summaries
  count = summarize(str(out))
  print(f"wrote {out}/results.csv, table.md and one PNG per task ({count} runs)", flush=True)


def summarize(out: str) -> int:
  """Rewrites OUT's CSV, table and plots from every run JSON there (earlier --only runs too)."""
  results = []
  for file in sorted(os.listdir(out)):
    if file.endswith(".json"):
      with open(os.path.join(out, file)) as f:
        results.append(json.load(f))
  write_summaries(out, results)
  from experiments import pages  # its values read this module

  pages.refresh_page(pathlib.Path(out))
  return len(results)


if __name__ == "__main__":
  define_flags()
  # experiments/page_values.py imports this module by name (summarize refreshes the page): it must
  # be this one, not a second copy that defines the flags again.
  sys.modules.setdefault("experiments.synthetic", sys.modules[__name__])
  app.run(main)
