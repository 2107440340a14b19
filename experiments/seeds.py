"""Seed replicates of a grid's runs (`--seeds=N`) and their mean and spread.

Seed 0 is each run as the grid defines it (the committed runs); replicate k = 1 .. N-1 is the
same run with train.seed raised by k, named `<run>-seed<k>` (a hyphen: the grids' own names use
underscores, e.g. the extrapolation grid's `<enc>_short_seed1`, which is a run of its own). A
fine-tune's replicate starts from its parent's replicate of the same k, and an evaluation-only
run's replicate evaluates it, so every replicate differs from its seed-0 run by the seed alone.

`summary` reads the finished records of a grid, seed-0 runs and their replicates alike, and gives
for every run with replicates the mean, sample standard deviation and range of one metric at
each length: the table that a verdict between arms closer than the seed noise needs.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Sequence

SEPARATOR = "-seed"
_REPLICATE = re.compile(rf"^(?P<run>.+){re.escape(SEPARATOR)}(?P<k>[1-9][0-9]*)$")


def parse_count(text: str | int) -> int:
  """--seeds: the number of seeds per run, >= 1 (1 = the grid as defined)."""
  try:
    count = int(text)
  except ValueError:
    raise ValueError(f"--seeds must be a whole number of seeds per run, got {text!r}") from None
  if count < 1:
    raise ValueError(f"--seeds must be >= 1 (1 = each run once), got {count}")
  return count


def replicate_name(run: str, k: int) -> str:
  return run if k == 0 else f"{run}{SEPARATOR}{k}"


def split_name(name: str) -> tuple[str, int]:
  """(the seed-0 run's name, k) of a run name; k = 0 for a seed-0 run."""
  match = _REPLICATE.match(name)
  return (match["run"], int(match["k"])) if match else (name, 0)


def replicate(runs: Sequence, count: int) -> list:
  """`runs` (grid.Run) then, for k = 1 .. count - 1, each run again with train.seed + k.

  Replicates come after every seed-0 run, each k in the grid's order, so a replicate's parent
  (its init_from or eval_of) always runs before it. Runs recorded as skipped are not repeated.
  """
  out = list(runs)
  for k in range(1, count):
    for run in runs:
      if run.skip_reason:
        continue
      overrides = dict(run.overrides)
      if not run.eval_of:  # an evaluation-only run takes its parent's config, seed included
        overrides["train.seed"] = int(run.overrides.get("train.seed", 0)) + k
      out.append(
        dataclasses.replace(
          run,
          name=replicate_name(run.name, k),
          overrides=overrides,
          init_from=run.init_from and replicate_name(run.init_from, k),
          eval_of=run.eval_of and replicate_name(run.eval_of, k),
        )
      )
  return out


def summary(
  rows: Sequence[dict],
  *,
  value: str,
  where: dict | None = None,
  by: Sequence[str] = (),
  digits: int = 3,
) -> list[str]:
  """Markdown lines: for every run with replicates among `rows` (one row per run, evaluation and
  length, e.g. grid.csv_rows, kept where they match `where`), `value`'s mean ± sample standard
  deviation and [min, max] over its seeds at each length; [] when no run has a replicate.

  `by` names the row fields that tell a run's evaluations apart (the grids' "scaling"): each
  gets its own line, labelled `run (field values)` unless they are all "" or "none".
  """
  where = where or {}
  by_run: dict[str, dict[int, dict[int, float]]] = {}
  for row in rows:
    if row.get(value) in (None, "") or any(str(row.get(k)) != str(v) for k, v in where.items()):
      continue
    run, k = split_name(row["run"])
    labels = [str(row.get(field, "")) for field in by]
    if any(label not in ("", "none") for label in labels):
      run = f"{run} ({', '.join(labels)})"
    by_run.setdefault(run, {}).setdefault(int(row["length"]), {})[k] = float(row[value])
  replicated = {
    run: lengths
    for run, lengths in by_run.items()
    if any(len(seeds) > 1 for seeds in lengths.values())
  }
  if not replicated:
    return []
  lengths = sorted({n for per_length in replicated.values() for n in per_length})
  lines = [
    "| run | seeds | " + " | ".join(str(n) for n in lengths) + " |",
    "|---|---|" + "---|" * len(lengths),
  ]
  for run, per_length in replicated.items():
    seeds = sorted({k for values in per_length.values() for k in values})
    cells = [_cell(list(per_length.get(n, {}).values()), digits) for n in lengths]
    lines.append(f"| {run} | {len(seeds)} | " + " | ".join(cells) + " |")
  return lines


def _cell(values: list[float], digits: int) -> str:
  if not values:
    return ""
  if len(values) == 1:
    return f"{values[0]:.{digits}f} (one seed)"
  mean, sd = statistics.fmean(values), statistics.stdev(values)
  return f"{mean:.{digits}f} ± {sd:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def seed_zero(records: Sequence[dict]) -> list[dict]:
  """The records (or CSV rows: anything with a "run") of seed-0 runs: what a grid's own tables
  show (replicates feed `section`)."""
  return [r for r in records if split_name(r.get("run", ""))[1] == 0]


def section(tables: Sequence[tuple[str, list[str]]]) -> list[str]:
  """table.md lines for each (heading, `summary` lines) that has lines, under "## Seed
  replicates: <heading>"; [] without replicates, so a grid without them keeps its table.md."""
  lines = []
  for heading, table in tables:
    if table:
      lines += ["", f"## Seed replicates: {heading}", ""]
      lines += [
        "Mean ± sample standard deviation [min, max] over each run's seeds (`--seeds`; replicate "
        f"k is `<run>{SEPARATOR}<k>`, train.seed + k).",
        "",
        *table,
      ]
  return lines
