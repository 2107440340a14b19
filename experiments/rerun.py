"""Retrains one committed grid run from its recorded settings and compares the final eval loss.

The committed results are meant to be what the drivers produce; this checks it for one run:
the run's JSON holds every config override it trained with (seed included), so training them
again into a fresh workdir must give the recorded validation loss (on CPU, to float rounding).

  python -m experiments.rerun results/extrapolation/pystdlib/rope_short.json [--workdir=DIR]

Prints the recorded and the new loss and their difference; exits 1 when they differ by more
than --tolerance (nats).
"""

from __future__ import annotations

import argparse
import json
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("run_json", type=pathlib.Path)
  parser.add_argument("--workdir", default="", help="default: a new temporary directory")
  parser.add_argument("--tolerance", type=float, default=1e-4)
  args = parser.parse_args()
  record = json.loads(args.run_json.read_text())
  if "final_eval" not in record:
    parser.error(f"{args.run_json}: not a trained run ({record.get('skipped', 'no final_eval')})")
  overrides = dict(record["overrides"])
  source = overrides.get("train.init_from", "")
  if source and not pathlib.Path(source).exists():
    parser.error(f"{record['run']} fine-tunes {source}, which is not on this machine")
  workdir = args.workdir or tempfile.mkdtemp(prefix=f"rerun_{record['run']}_")
  from roformer.train import loop as train_loop

  base = record["base"] if "base" in record else base_config(args.run_json.parent)
  config = grid.make_config(base, overrides)
  result = train_loop.train_and_evaluate(config, workdir)
  recorded, new = record["final_eval"]["loss"], float(result["loss"])
  diff = new - recorded
  print(f"{record['run']}: recorded eval loss {recorded:.6f}, rerun {new:.6f}, diff {diff:+.2e}")
  print(f"workdir: {workdir}")
  sys.exit(0 if abs(diff) <= args.tolerance else 1)


if __name__ == "__main__":
  main()
