"""Retrains one committed grid run from its recorded settings and compares its results.

The committed results are meant to be what the drivers produce; this checks it for one run:
the run's JSON holds every config override it trained with (seed included), so training them
again into a fresh workdir must give the recorded results (on CPU, to float rounding).

  python -m experiments.rerun results/extrapolation/pystdlib/rope_short.json [--workdir=DIR]
  python -m experiments.rerun results/synthetic/copy__irope.json

A perplexity grid's run (extrapolation, extension, MLM) compares the final validation loss, and
the run's tokenizer with the recorded one (its SHA-256, in the JSONs written since grids record
it): a different tokenizer explains a different loss without the model changing. A synthetic
run compares its task scores (exact match and per-token accuracy at every length). A synthetic
JSON written before the grid recorded overrides has them rebuilt from its arm's name
(configs/arms.py) and the grid's settings (experiments/synthetic.py), checked against the
settings the JSON records; a run that starts from another (DroPE, rope_continued) retrains that
one first.

Prints the recorded and the new numbers and their difference; exits 1 when they differ by more
than --tolerance (nats, or accuracy).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile

from experiments import grid, report


def base_config(results_dir: pathlib.Path) -> str:
  """The driver's base config for the grid whose report is in `results_dir`."""
  scale, _ = report.read_header(results_dir)
  if results_dir.parent.name == "mlm":
    from experiments import mlm

    return mlm.SCALES[scale]["base"]
  from experiments import extrapolation

  return extrapolation.SCALES[scale].base


def is_synthetic(record: dict) -> bool:
  """A run of experiments/synthetic.py: task scores, no final validation loss."""
  return "task" in record and "records" in record and "final_eval" not in record


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("run_json", type=pathlib.Path)
  parser.add_argument("--workdir", default="", help="default: a new temporary directory")
  parser.add_argument("--tolerance", type=float, default=1e-4)
  args = parser.parse_args()
  record = json.loads(args.run_json.read_text())
  if is_synthetic(record):
    diff = rerun_synthetic(parser, args, record)
  else:
    diff = rerun_perplexity(parser, args, record)
  sys.exit(0 if diff <= args.tolerance else 1)


def _workdir(args, run: str) -> pathlib.Path:
  stem = run.replace("/", "__")
  return pathlib.Path(args.workdir or tempfile.mkdtemp(prefix=f"rerun_{stem}_"))


def rerun_perplexity(parser, args, record: dict) -> float:
  """Retrains an extrapolation, extension or MLM run; returns |new - recorded| final eval loss."""
  if "final_eval" not in record:
    parser.error(f"{args.run_json}: not a trained run ({record.get('skipped', 'no final_eval')})")
  overrides = dict(record["overrides"])
  source = overrides.get("train.init_from", "")
  if source and not pathlib.Path(source).exists():
    parser.error(f"{record['run']} fine-tunes {source}, which is not on this machine")
  workdir = _workdir(args, record["run"])
  base = record["base"] if "base" in record else base_config(args.run_json.parent)
  config = grid.make_config(base, overrides)
  result = grid.train_to_end(record["run"], config, workdir)
  recorded, new = record["final_eval"]["loss"], float(result["loss"])
  diff = new - recorded
  print(f"{record['run']}: recorded eval loss {recorded:.6f}, rerun {new:.6f}, diff {diff:+.2e}")
  print(tokenizer_line(record.get("tokenizer_sha256"), grid.tokenizer_sha256(workdir)))
  print(f"workdir: {workdir}")
  return abs(diff)


def tokenizer_line(recorded: str | None, new: str) -> str:
  """Whether the rerun's tokenizer is the recorded run's (SHA-256 of tokenizer.json)."""
  if not new and not recorded:
    return "tokenizer: bytes (no file)"
  if recorded is None:
    return (
      f"tokenizer: sha256 {new[:16]}; the record keeps no tokenizer hash (written before grids "
      "recorded it), so a loss difference may come from the tokenizer"
    )
  if recorded != new:
    return (
      f"tokenizer: DIFFERS (recorded sha256 {recorded[:16]}, rerun {new[:16]}): the loss "
      "difference may come from the tokenizer, not the model"
    )
  return f"tokenizer: the recorded one (sha256 {new[:16]})"


def rerun_synthetic(parser, args, record: dict) -> float:
  """Retrains a synthetic-task run; returns the largest score difference over its lengths."""
  from experiments import synthetic

  task, encoding, randomized = record["task"], record["encoding"], record["randomized"]
  workdir = _workdir(args, record["run"])
  workroot = workdir / "runs"  # the runs it starts from, named as the grid names them
  scale_name, scale = _synthetic_scale(parser, synthetic, task, encoding)
  spec = record["settings"]["eval"]
  if "overrides" in record:
    config = grid.make_config(record.get("base", ""), record["overrides"])
    how = "its recorded overrides"
  else:
    config = synthetic.run_config(scale, task, encoding, randomized, workroot)
    how = (
      f"overrides rebuilt from its arm ({encoding}: configs/arms.py) and the {scale_name} grid's "
      "settings (experiments/synthetic.py); the JSON records none"
    )
  # The arm trained: an evaluation arm scores its run's checkpoint with an option applied.
  trained = synthetic.EVALUATIONS[encoding][0] if encoding in synthetic.EVALUATIONS else encoding
  if trained in synthetic.RECALIBRATIONS:  # the run it continues trains here, in the workroot
    config.train.init_from = str(synthetic.parent_workdir(scale, task, trained, workroot))
  # The config must be the one the JSON's settings describe, field by field.
  settings = grid.run_settings(config, spec, workroot=workroot)
  grid.finished_record(args.run_json, settings)  # exits naming the fields that differ
  print(f"{record['run']}: config from {how}: matches the recorded settings", flush=True)
  if trained in synthetic.RECALIBRATIONS:
    synthetic.restore_parent(scale, task, trained, workroot, args.run_json.parent)
  grid.train_to_end(record["run"], config, workdir / "run")
  result = synthetic.score(str(workdir / "run"), spec)
  worst = 0.0
  new_by_length = {r["length"]: r for r in result["records"]}
  if set(new_by_length) != {r["length"] for r in record["records"]}:
    print(f"  lengths differ: recorded {[r['length'] for r in record['records']]}, "
          f"rerun {sorted(new_by_length)}")  # fmt: skip
    worst = math.inf
  for old in record["records"]:
    new = new_by_length.get(old["length"], {"skipped": "not scored"})
    if "skipped" in old or "skipped" in new:
      print(f"  n={old['length']}: skipped ({old.get('skipped')} / {new.get('skipped')})")
      if ("skipped" in old) != ("skipped" in new):  # scored on one side only: a difference
        worst = math.inf
      continue
    cells = []
    for metric in ("exact_match", "token_accuracy"):
      diff = new[metric] - old[metric]
      worst = max(worst, abs(diff))
      cells.append(f"{metric} recorded {old[metric]:.6f}, rerun {new[metric]:.6f} ({diff:+.2e})")
    print(f"  n={old['length']}: " + "; ".join(cells))
  print(f"{record['run']}: largest difference {worst:.2e}")
  print(f"workdir: {workdir}")
  return worst


def _synthetic_scale(parser, synthetic, task: str, encoding: str):
  """(name, Scale) of the synthetic grid's committed scale, which runs `task` with `encoding`."""
  name = "cpu"  # grid.check_out: results/ holds only the cpu scale's runs
  scale = synthetic.SCALES[name]
  if task not in scale.tasks or encoding not in scale.encodings:
    parser.error(f"the {name} synthetic grid has no {task} run of {encoding}")
  return name, scale


if __name__ == "__main__":
  main()
