"""Training-free context extension compared on one RoPE decoder: every `--extend` kind and every
RoPE scaling, perplexity from L to 16L and long-context tasks to 8x their training lengths.

Perplexity: the extrapolation grid's `rope` run (the same settings: corpus, model, budget and
seed; retrained here into this grid's own workdir), then each method applied to its final
checkpoint at evaluation, nothing trained: Position Interpolation, NTK, dynamic NTK, YaRN and
Llama 3 (factor = length / L at each length), Self-Extend, Dual Chunk Attention, ReRoPE, STRING,
StreamingLLM's attention sinks, and the plain sliding window of the sinks' cache size (the sinks'
control). Each method takes the settings its paper gives in units of the training length L
(`methods`). LongRoPE is not an arm: its per-dimension factors come from a search on the model
(they are read from a pretrained model's config.json, `eval.py --hf_model`).

Tasks: a RoPE decoder trained on each task (the synthetic grid's model and budget, training
lengths as there), then scored at the default task lengths under each method: passkey (RULER's
single needle in a noise haystack) and RULER's multi-value needle in a haystack (its multi-key one
is not learned by this model in 3x the budget: docs/long_context.md).

  python -m experiments.extension [--scale=tiny|cpu] [--corpus=pystdlib|sotu] [--only=yarn,dca]
      [--tasks=passkey,niah_multivalue] [--out=DIR] [--workroot=DIR]
  python -m experiments.extension --hf_model=HF_DIR --data_files=GLOB --out=DIR  # a pretrained
      # decoder (its tokenizer.json; L = its max_position_embeddings); perplexity only

Writes OUT (default results/extension/<corpus>): <run>.json per run, results.csv (perplexity),
tasks.csv (task scores), table.md, perplexity.png and <task>.png. Finished runs are skipped, so
a killed grid resumes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

from experiments import extension_report, extrapolation, grid, pages, seeds, synthetic
from roformer.data import synthetic as synthetic_data

SCALINGS = ("linear", "ntk", "dynamic", "yarn", "llama3")
# Each method as its reference code runs it by default; dca_paper and rerope_clamp are the
# variants the papers describe (roformer/posenc/extension.py).
EXTENSIONS = ("self_extend", "dca", "dca_paper", "rerope", "rerope_clamp", "string", "sinks")
METHODS = ("plain", *SCALINGS, *EXTENSIONS, "window")
SINKS = 4  # StreamingLLM's attention sinks


def _task_scale(name: str, tasks: tuple[str, ...]) -> synthetic.Scale:
  """The synthetic grid's scale `name` (model, budget, examples) on `tasks`, each at passkey's
  training lengths."""
  base = synthetic.SCALES[name]
  return dataclasses.replace(base, tasks={task: base.tasks["passkey"] for task in tasks})


TASK_SCALES = {
  "tiny": _task_scale("tiny", ("passkey",)),
  "cpu": _task_scale("cpu", ("passkey", "niah_multivalue")),
}


def methods(L: int, longest: int) -> dict[str, dict]:
  """Each method's evaluation options (`evals.spec.spec_from_options`) for a model trained at
  length L evaluated up to `longest`, with the papers' settings in units of L:

  - scalings: factor = evaluated length / L at each length ("auto");
  - self_extend (arXiv 2401.01325, LongLM's code): neighbour window W = L/4, group G the
    smallest that keeps every grouped distance inside the training length: floor((longest - 1)
    / G) + W - W / G <= L - 1 (the paper's rule (L - W) G + W >= longest, with the reference
    code's positions);
  - dca (ChunkLlama, arXiv 2402.17463): its code's defaults since 2024-04-25, chunk_size = 3L/4
    and local_window = L/8, i.e. chunks of s = 3L/4 - L/8 keys (its chunk_len) and w = L/8, and
    its cos/sin factor beyond L; dca_paper: local_window = L/16 as the code was released with
    the paper (2024-02-28), no factor (which the code says the paper did not use);
  - rerope (Su 2023): distances clamped at L/8 (512 at L = 4096) and queries times
    max(1, ln(i + 1) / ln L) as `rerope_patch.py`; rerope_clamp: the clamp alone;
  - string (arXiv 2410.18745): shifted offset S = L/3, local value W = 128 (the paper's), at
    most L/16 (its value for its 2K-context models; 8 at L = 128);
  - sinks (arXiv 2309.17453): 4 sink tokens and the L - 4 most recent keys (a cache of L; at
    least one recent key);
  - window: the L most recent keys, no sinks (the sinks' control).
  """
  W = max(1, L // 4)
  string_local = min(128, max(1, L // 16))
  group = 1
  while (longest - 1) // group + W - W / group > L - 1:
    group += 1

  def dca(local_divisor: int) -> dict:
    local = max(1, L // local_divisor)
    return dict(chunk=max(2, 3 * L // 4 - local), local=local)

  rerope = dict(window=max(1, L // 8))
  return {
    "plain": {},
    **{kind: dict(rope_scaling=kind, rope_factor="auto") for kind in SCALINGS},
    "self_extend": dict(extend="self_extend", extend_fields=dict(window=W, group=group)),
    "dca": dict(extend="dca", extend_fields=dict(dca(8), train_len=L)),
    "dca_paper": dict(extend="dca_paper", extend_fields=dca(16)),
    "rerope": dict(extend="rerope", extend_fields=dict(rerope, train_len=L)),
    "rerope_clamp": dict(extend="rerope_clamp", extend_fields=rerope),
    "string": dict(extend="string", extend_fields=dict(shift=max(2, L // 3), local=string_local)),
    "sinks": dict(extend="sinks", extend_fields=dict(sinks=SINKS, window=max(1, L - SINKS))),
    "window": dict(attention_window=L),
  }


def perplexity_runs(scale: extrapolation.Scale, only: set[str]) -> list[grid.Run]:
  """The rope run (evaluated as trained) and one evaluation-only run per other method."""
  L = scale.seq_len
  lengths = [L * m for m in scale.multiples]
  curve = dict(lengths=lengths, protocol="nonoverlapping", max_tokens=scale.eval_tokens)
  options = methods(L, lengths[-1])
  rope = {"posenc.kind": "rope", "train.num_train_steps": scale.steps}
  runs = [grid.Run("rope", "rope", rope, [grid.Eval("plain", curve)])]
  for name in METHODS[1:]:
    if not only or name in only:
      evals = [grid.Eval(name, dict(curve, **options[name]))]
      runs.append(grid.Run(f"rope_{name}", "rope", {}, evals, eval_of="rope", budget="eval"))
  return runs


def task_config(scale: synthetic.Scale, task: str):
  """A RoPE decoder trained on `task` as the synthetic grid trains it (model, budget, lengths)."""
  return synthetic.run_config(scale, task, "rope", False)


def task_runs(scale: synthetic.Scale, task: str, only: set[str]) -> list[grid.Run]:
  """The task's rope run (scored as trained) and one evaluation-only run per other method."""
  config = task_config(scale, task)
  spec = synthetic.eval_spec(scale, task, False)
  longest = synthetic_data.example_length(task, max(spec["lengths"])) - 1
  scores = dict(task_lengths=spec["lengths"], task_examples=spec["examples"])
  options = methods(config.data.seq_len, longest)
  runs = [grid.Run(task, "rope", {}, [grid.Eval("plain", scores)])]
  for name in METHODS[1:]:
    if not only or name in only:
      evals = [grid.Eval(name, dict(scores, **options[name]))]
      runs.append(grid.Run(f"{task}_{name}", "rope", {}, evals, eval_of=task, budget="eval"))
  return runs


def every_record(out: pathlib.Path, args) -> tuple[list[dict], dict[str, list[dict]]]:
  """The finished records of the perplexity runs and of each task's runs, in grid order."""
  ppl = grid.finished_records(perplexity_runs(extrapolation.SCALES[args.scale], set()), out)
  tasks = {}
  for task in TASK_SCALES[args.scale].tasks:
    runs = task_runs(TASK_SCALES[args.scale], task, set())
    tasks[task] = grid.finished_records(runs, out / "tasks")
  return ppl, tasks


def run_hf_model(args, out: pathlib.Path) -> None:
  """Every method's perplexity on a pretrained decoder: one eval.py evaluation each, written to
  OUT/hf_<method>.json with its settings; a method whose JSON holds today's settings is skipped,
  and the report covers every finished method."""
  from roformer import hf
  from roformer.evals import ppl_vs_length
  from roformer.evals import spec as spec_lib

  if not args.data_files:
    raise SystemExit("--hf_model needs --data_files=GLOB: the text its perplexity is scored on")
  hf_config = hf.read_hf_config(args.hf_model)  # L and the scaling, without the weights
  L = int(hf_config.get("max_position_embeddings") or 0)
  if L < 1:
    raise SystemExit(f"--hf_model={args.hf_model}: config.json has no max_position_embeddings")
  try:
    scaling = hf.hf_decoder_config(hf_config).posenc.scaling
  except hf.HFConversionError as e:
    raise SystemExit(f"--hf_model={args.hf_model}: {e}") from None
  if scaling.kind != "none":
    print(
      f"{args.hf_model} scales RoPE itself ({scaling.kind}, factor {scaling.factor:g}): `plain` "
      "evaluates it so, the scalings replace it, the --extend kinds apply on top of it; L = "
      f"max_position_embeddings = {L}",
      flush=True,
    )
  lengths = [L * m for m in (1, 2, 4, 8, 16)]
  options = methods(L, lengths[-1])
  chosen = [m for m in METHODS if not args.only_set or m in args.only_set]
  for i, name in enumerate(chosen, start=1):
    path = out / f"hf_{name}.json"
    settings = dict(
      hf_model=str(pathlib.Path(args.hf_model).resolve()), data_files=args.data_files,
      lengths=lengths, max_tokens=args.max_tokens, options=options[name],
    )  # fmt: skip
    settings = json.loads(json.dumps(settings))
    if path.exists():
      if json.loads(path.read_text()).get("settings") == settings:
        print(f"[{i}/{len(chosen)}] {name}: done (skipped)", flush=True)
        continue
      raise SystemExit(f"{path} was made with other settings; delete it or give another --out")
    print(f"[{i}/{len(chosen)}] {name}", flush=True)
    spec = spec_lib.spec_from_options(
      lengths=lengths, protocol="nonoverlapping", max_tokens=args.max_tokens,
      data_files=args.data_files, out=f"extension_{name}", **options[name],
    )  # fmt: skip
    result, _ = ppl_vs_length.evaluate_workdir(
      out, spec, hf_model=args.hf_model, overwrite=True,
      log=lambda line: print("    " + line, flush=True),
    )  # fmt: skip
    record = {"run": f"hf_{name}", "encoding": "rope", "budget": "eval", "eval_of": "hf"}
    record.update(evaluations=[{"scaling": name, "result": result}], settings=settings)
    path.write_text(json.dumps(record, indent=2) + "\n")
  paths = [out / f"hf_{m}.json" for m in METHODS]
  records = [json.loads(p.read_text()) for p in paths if p.exists()]
  name = pathlib.Path(args.hf_model).name
  extension_report.write_extension(records, {}, out, seq_len=L, scale="hf", subject=name)


def main():
  def extra_args(parser):
    parser.add_argument(
      "--tasks", default=None, help="comma-separated tasks (default: the scale's; '' = none)"
    )
    parser.add_argument("--hf_model", default="", help="a Hugging Face decoder directory")
    parser.add_argument("--data_files", default=None, help="with --hf_model: the text to score")
    parser.add_argument("--max_tokens", type=int, default=None, help="with --hf_model (65,536)")

  args, only, out, workroot = grid.parse_cli(
    __doc__, name="extension", scales=extrapolation.SCALES, encodings=METHODS,
    extra_args=extra_args,
  )  # fmt: skip
  args.only_set = only
  given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
  if args.hf_model:
    if "--out" not in given:
      raise SystemExit("--hf_model needs --out=DIR (results/ holds the grid's committed runs)")
    foreign = sorted(given & {"--tasks", "--scale", "--corpus", "--workroot", "--adopt", "--seeds"})
    if foreign:
      raise SystemExit(f"{', '.join(foreign)}: not read with --hf_model (perplexity on its text)")
    args.max_tokens = 65_536 if args.max_tokens is None else args.max_tokens
    out.mkdir(parents=True, exist_ok=True)
    return run_hf_model(args, out)
  foreign = sorted(given & {"--data_files", "--max_tokens"})
  if foreign:
    raise SystemExit(f"{', '.join(foreign)}: read only with --hf_model (the grid uses its corpus)")
  task_scale = TASK_SCALES[args.scale]
  tasks = list(task_scale.tasks) if args.tasks is None else [t for t in args.tasks.split(",") if t]
  unknown = set(tasks) - set(task_scale.tasks)
  if unknown:
    raise SystemExit(f"--tasks: unknown {sorted(unknown)}; choose from {tuple(task_scale.tasks)}")
  scale = extrapolation.SCALES[args.scale]

  def write_report(_=None):
    ppl, tasks = every_record(out, args)
    extension_report.write_extension(ppl, tasks, out, seq_len=scale.seq_len, scale=args.scale)
    pages.refresh_page(out)

  runs = perplexity_runs(scale, only)
  print(f"extension grid, scale {args.scale}, corpus {args.corpus} -> {out}")
  grid.run_grid(
    seeds.replicate(runs, args.seeds), base=scale.base,
    common=extrapolation.common_overrides(scale, args.corpus), out=out, workroot=workroot,
    report=write_report, adopt=args.adopt,
  )  # fmt: skip
  for task in tasks:
    common = grid.flat_fields(task_config(task_scale, task))
    grid.run_grid(
      seeds.replicate(task_runs(task_scale, task, only), args.seeds), base="", common=common,
      out=out / "tasks",
      workroot=workroot / "tasks", report=write_report, adopt=args.adopt,
    )  # fmt: skip
  write_report()
  print(f"wrote {out}/table.md, results.csv and perplexity.png" + (", tasks.csv" if tasks else ""))


if __name__ == "__main__":
  main()
