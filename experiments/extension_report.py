"""experiments/extension.py's outputs: results.csv, tasks.csv, table.md and the plots, from the
runs' records (the same files come back from the same JSONs: tests/e2e/results_test.py)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from experiments import grid, report, seeds
from roformer.evals import plots, task_plots
from roformer.evals.effective_length import RULER_THRESHOLD, EffectiveRule, task_effective_lengths
from roformer.posenc.config import EXTENSION_FIELDS

RULER = EffectiveRule(threshold=RULER_THRESHOLD)  # the task tables' "RULER's n" column
TASK_COLUMNS = ("task", "run", "method", "length", "tokens", "exact_match", "token_accuracy")


def method_settings(method: str, result: dict) -> str:
  """What a method set, from its evaluation JSON: the extension's numbers, the scaling's factor
  or the imposed window; "as trained" for "plain" (with the model's own RoPE scaling, if any)."""
  scaling = result.get("rope_scaling")
  if method == "plain":
    return "as trained" + (f" ({scaling['kind']}, factor {scaling['factor']})" if scaling else "")
  extension = result.get("context_extension")
  if extension:
    return ", ".join(f"{f} {extension[f]}" for f in EXTENSION_FIELDS[extension["kind"]])
  if scaling:
    return f"factor {scaling['factor']}"
  window = result.get("attention_window")
  return f"window {window['size']}" if window else ""


def _evaluations(records: Sequence[dict]):
  for record in records:
    for ev in record.get("evaluations", []):
      yield record, ev


def task_rows(task: str, records: Sequence[dict]) -> list[dict]:
  rows = []
  for record, ev in _evaluations(records):
    for r in ev["result"]["records"]:
      if "skipped" not in r:
        row = {"task": task, "run": record["run"], "method": ev["scaling"], "length": r["length"]}
        row["tokens"] = r["tokens"]
        row.update({m: f"{r[m]:.6f}" for m in ("exact_match", "token_accuracy")})
        rows.append(row)
  return rows


def _perplexity_table(records, rows, seq_len: int) -> list[str]:
  lengths = sorted({int(r["length"]) for r in rows})
  lines = ["## Perplexity, non-overlapping windows", ""]
  lines += ["| method | settings | " + " | ".join(str(n) for n in lengths) + " | effective L |"]
  lines += ["|---|---|" + "---|" * (len(lengths) + 1)]
  for record, ev in _evaluations(records):
    cells = [
      report._fmt(report._ppl(rows, run=record["run"], length=n, protocol="nonoverlapping"))
      for n in lengths
    ]
    cells.append(report._effective(ev["result"], "nonoverlapping", seq_len))
    settings = method_settings(ev["scaling"], ev["result"])
    lines.append(f"| {ev['scaling']} | {settings} | " + " | ".join(cells) + " |")
  return lines


def _task_table(task: str, records, rows) -> list[str]:
  lengths = sorted({int(r["length"]) for r in rows})
  first = records[0]["evaluations"][0]["result"]
  lo, hi = first.get("train_lengths", (0, 0))
  lines = [f"## {task}: exact match (trained on lengths {lo}..{hi})", ""]
  head = " | ".join(f"n={n}" for n in lengths)
  lines += [f"| method | settings | {head} | effective n | RULER's n |"]
  lines += ["|---|---|" + "---|" * (len(lengths) + 2)]
  for record, ev in _evaluations(records):
    cells = []
    for n in lengths:
      row = grid.lookup(rows, run=record["run"], length=n)
      cells.append(f"{float(row['exact_match']):.2f}" if row else "–")
    effective = ev["result"].get("effective_length", {}).get("exact_match", {})
    cells.append(_effective_n(effective))
    cells.append(_effective_n(task_effective_lengths(ev["result"], RULER)["exact_match"]))
    settings = method_settings(ev["scaling"], ev["result"])
    lines.append(f"| {ev['scaling']} | {settings} | " + " | ".join(cells) + " |")
  return lines


def _effective_n(effective: dict) -> str:
  if not effective or effective.get("length") is None:
    return "–"
  return f"{effective['length']}" + ("+" if effective.get("first_failing") is None else "")


def write_extension(
  records: Sequence[dict],
  task_records: dict[str, Sequence[dict]],
  out: pathlib.Path,
  *,
  seq_len: int,
  scale: str,
  subject: str = "",
  draw: bool = True,
) -> None:
  """results.csv, tasks.csv, table.md, and unless not `draw` perplexity.png and <task>.png of the
  extension grid (`subject` names what was evaluated in the heading; default "<scale> scale";
  seed replicates: in the CSVs and their own tables)."""
  every_row = grid.csv_rows(records)
  grid.write_csv(every_row, out / "results.csv")
  records = seeds.seed_zero(records)
  rows = seeds.seed_zero(every_row)
  subject = subject or f"{scale} scale"
  lines = [f"# Training-free context extension ({subject}, training length {seq_len})", ""]
  lines += [
    "One RoPE checkpoint per table, every method applied at evaluation (nothing trained); "
    "settings in units of the training length as experiments/extension.py's `methods` gives "
    "them. Effective L: the last length before the first whose loss is more than -ln 0.9 = "
    f"0.105 nats above the loss at {seq_len}; effective n: the last task length whose exact "
    "match stays at or above 0.9 of the score at the longest training length; RULER's n: the "
    f"last whose exact match stays at or above RULER's absolute limit, {RULER_THRESHOLD}.",
    "",
  ]
  if records:
    lines += _perplexity_table(records, rows, seq_len)
  all_task_rows, seed_tables = [], []
  for task, task_recs in task_records.items():
    if task_recs:
      trows = task_rows(task, task_recs)
      all_task_rows += trows
      task_recs = seeds.seed_zero(task_recs)
      lines += ["", *_task_table(task, task_recs, seeds.seed_zero(trows))]
      em = seeds.summary(trows, value="exact_match")
      seed_tables.append((f"{task}, exact match", em))
      runs = [(ev["scaling"], ev["result"]) for _, ev in _evaluations(task_recs)]
      if draw:
        task_plots.plot_task_runs(
          runs, out / f"{task}.png", title=f"{task}: context extension at evaluation ({subject})"
        )
  if all_task_rows:
    grid.write_csv(all_task_rows, out / "tasks.csv", TASK_COLUMNS)
  ppl = seeds.summary(every_row, value="ppl", where=dict(protocol="nonoverlapping"))
  lines += seeds.section([("perplexity, non-overlapping", ppl), *seed_tables])
  (out / "table.md").write_text("\n".join(lines) + "\n")
  curves = [
    (ev["scaling"], report._protocol_only(ev["result"], "nonoverlapping"), seq_len)
    for _, ev in _evaluations(records)
  ]
  if curves and draw:
    plots.plot_runs(
      curves, out / "perplexity.png", title=f"Training-free context extension ({subject})"
    )
