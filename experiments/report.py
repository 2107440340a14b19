"""The grids' outputs: results.csv, table.md and the plots, from the runs' records.

python -m experiments.report results/<grid> ...   # rewrite a committed grid's report and page
                                                  # from its run JSONs (experiments/pages.py)
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Sequence

from experiments import grid, seeds
from roformer.evals import plots
from roformer.evals.effective_length import EffectiveRule, perplexity_effective_lengths


def read_header(directory: pathlib.Path) -> tuple[str, int]:
  """(scale, training length) from the first line of a grid's table.md."""
  first = (directory / "table.md").read_text().splitlines()[0]
  match = re.search(r"\((\w+) scale, training length (\d+)\)", first)
  if match is None:
    raise ValueError(f"{directory}/table.md: no '(<scale> scale, training length <L>)' header")
  return match.group(1), int(match.group(2))


def _fmt(value: float | None) -> str:
  if value is None:
    return "–"
  return f"{value:.2f}" if value < 1000 and math.isfinite(value) else f"{value:.3g}"


def _ppl(rows, **where) -> float | None:
  row = grid.lookup(rows, **where)
  return None if row is None else float(row["ppl"])


def _scaling_run(record: dict, seq_len: int) -> bool:
  """The rope runs drawn with the scalings: the full-budget run and its fine-tunes at a longer
  length (PI, YaRN); not the runs continued at L (DroPE's control, in the frontier table)."""
  if record.get("encoding") != "rope" or "evaluations" not in record:
    return False
  if record.get("budget") == "full":
    return True
  trained_at = record.get("settings", {}).get("data.seq_len", seq_len)
  return record.get("budget") == "finetune" and trained_at != seq_len


def _wall_table(records: Sequence[dict]) -> list[str]:
  lines = ["| run | budget | training time (min) |", "|---|---|---|"]
  total = 0.0
  for r in records:
    if "train_seconds" in r:
      total += r["train_seconds"]
      lines.append(f"| {r['run']} | {r['budget']} | {r['train_seconds'] / 60:.1f} |")
  lines.append(f"| all | | {total / 60:.1f} |")
  return lines


def _seed_table(records: Sequence[dict], rows: list[dict], seq_len: int) -> list[str]:
  """The quarter-budget runs with seed 0 and seed 1: how far a rerun moves perplexity at L."""
  seeds = [r for r in records if r.get("budget") == "seed"]
  if not seeds:
    return []
  lines = ["", "## Seed noise: quarter budget, perplexity at L (non-overlapping)", ""]
  lines += ["| encoding | seed 0 | seed 1 | seed 1 / seed 0 |", "|---|---|---|---|"]
  for r in seeds:
    enc = r["encoding"]
    seed0 = _ppl(rows, run=f"{enc}_short", length=seq_len, protocol="nonoverlapping")
    seed1 = _ppl(rows, run=r["run"], length=seq_len, protocol="nonoverlapping")
    ratio = seed1 / seed0 if seed0 and seed1 else None
    lines.append(f"| {enc} | {_fmt(seed0)} | {_fmt(seed1)} | {_fmt(ratio)} |")
  return lines


def write_extrapolation(
  records: Sequence[dict], out: pathlib.Path, *, seq_len: int, scale: str, draw: bool = True
):
  """results.csv, table.md, and unless not `draw` the plots encodings.png, scalings.png and
  frontier.png of the extrapolation grid (seed replicates: in results.csv and their own table)."""
  every_row = grid.csv_rows(records)
  grid.write_csv(every_row, out / "results.csv")
  records = seeds.seed_zero(records)
  rows = seeds.seed_zero(every_row)
  lengths = sorted({int(r["length"]) for r in rows})
  full = [r for r in records if r.get("budget") == "full" and "evaluations" in r]
  lines = [f"# Length extrapolation ({scale} scale, training length {seq_len})", ""]
  lines += [
    "Effective L: eval.py's default limit, relative to the run's own loss, read as RULER reads "
    "its effective length: the last length before the first whose loss is more than -ln 0.9 = "
    f"0.105 nats above the loss at {seq_len}, read from {seq_len} up "
    f"(`{lengths[-1] if lengths else 0}+`: no evaluated length leaves the margin). Not RULER's "
    "effective length, whose limit is one absolute task score for every model.",
    "",
  ]
  for protocol in ("nonoverlapping", "sliding"):
    lines += [
      f"## Perplexity, {protocol} windows" + (" (stride L/4)" if protocol == "sliding" else ""),
      "",
      "| encoding | " + " | ".join(str(n) for n in lengths) + " | effective L |",
      "|---|" + "---|" * (len(lengths) + 1),
    ]
    for r in full:
      for ev in r["evaluations"]:
        if ev["scaling"] not in ("none", "bca"):
          continue
        name = r["run"] + (" (BCA)" if ev["scaling"] == "bca" else "")
        if r["encoding"] == "xpos" and ev["scaling"] == "none":
          name += " (no BCA)"
        cells = [
          _fmt(_ppl(rows, run=r["run"], scaling=ev["scaling"], length=n, protocol=protocol))
          for n in lengths
        ]
        cells.append(_effective(ev["result"], protocol, seq_len))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
  lines += [
    "## RoPE scalings (non-overlapping windows; factor = length / L at evaluation)",
    "",
    "| run | scaling | " + " | ".join(str(n) for n in lengths) + " |",
    "|---|---|" + "---|" * len(lengths),
  ]
  for r in records:
    if not _scaling_run(r, seq_len):
      continue
    for ev in r["evaluations"]:
      cells = [
        _fmt(_ppl(rows, run=r["run"], scaling=ev["scaling"], length=n, protocol="nonoverlapping"))
        for n in lengths
      ]
      label = ev["scaling"] if r["budget"] == "full" else f"fine-tuned at 2L ({r['run']})"
      lines.append(f"| {r['run']} | {label} | " + " | ".join(cells) + " |")
  lines += ["", "## Training budget: perplexity at L (non-overlapping)", ""]
  lines += ["| encoding | short budget | ratio to rope | full budget | ratio to rope |"]
  lines += ["|---|---|---|---|---|"]
  for r in full:
    enc = r["encoding"]
    short = _ppl(rows, run=f"{enc}_short", length=seq_len, protocol="nonoverlapping")
    long = _ppl(rows, run=enc, scaling="none", length=seq_len, protocol="nonoverlapping")
    rope_short = _ppl(rows, run="rope_short", length=seq_len, protocol="nonoverlapping")
    rope_long = _ppl(rows, run="rope", scaling="none", length=seq_len, protocol="nonoverlapping")
    ratio_s = short / rope_short if short and rope_short else None
    ratio_l = long / rope_long if long and rope_long else None
    lines.append(f"| {enc} | {_fmt(short)} | {_fmt(ratio_s)} | {_fmt(long)} | {_fmt(ratio_l)} |")
  lines += _frontier_table(records, rows, lengths)
  lines += _seed_table(records, rows, seq_len)
  lines += ["", "## Wall time", ""] + _wall_table(records)
  nonoverlapping = dict(protocol="nonoverlapping")
  ppl = seeds.summary(every_row, value="ppl", where=nonoverlapping, by=("scaling",))
  lines += seeds.section([("perplexity, non-overlapping", ppl)]) + [""]
  (out / "table.md").write_text("\n".join(lines))
  if not draw:
    return

  def label(record, ev):
    return plots.run_label(record["run"], {**ev["result"], "posenc": record["run"]})

  encodings = grid.eval_lines(
    records,
    lambda r, ev: r.get("budget") == "full" and ev["scaling"] in ("none", "bca"),
    label,
  )
  if encodings:
    plots.plot_runs(
      [(lab, res, seq_len) for lab, res in encodings],
      out / "encodings.png",
      title=f"Perplexity vs length, every encoding ({scale} scale)",
    )
  scalings = grid.eval_lines(
    records,
    lambda r, ev: _scaling_run(r, seq_len),
    lambda r, ev: f"{r['run']} + {ev['scaling']} (auto)" if ev["scaling"] != "none" else r["run"],
  )
  if scalings:
    plots.plot_runs(
      [(lab, _protocol_only(res, "nonoverlapping"), seq_len) for lab, res in scalings],
      out / "scalings.png",
      title=f"RoPE context extension ({scale} scale)",
    )
  frontier = grid.eval_lines(
    records,
    _is_frontier,
    lambda r, ev: r["run"] if ev["scaling"] == "none" else f"{r['run']} + {ev['scaling']}",
  )
  if any(lab not in ("rope", "nope") for lab, _ in frontier):
    plots.plot_runs(
      [(lab, _protocol_only(res, "nonoverlapping"), seq_len) for lab, res in frontier],
      out / "frontier.png",
      title=f"The 2024-26 options against rope and nope ({scale} scale)",
    )


def _effective(result: dict, protocol: str, seq_len: int) -> str:
  """A table cell: the effective length of one protocol ("1024+" when no evaluated length
  leaves the margin, "–" without one)."""
  found = perplexity_effective_lengths(result["records"], EffectiveRule(), train_length=seq_len)
  found = found.get(protocol)
  if found is None or found["length"] is None:
    return "–"
  return f"{found['length']}" + ("+" if found["first_failing"] is None else "")


def _is_frontier(record: dict, ev: dict) -> bool:
  """The runs of the 2024-26 table: rope and nope as trained (the references), the frontier
  arms, the evaluation-only runs and the recalibrations of rope (DroPE and its control)."""
  if record.get("budget") in ("frontier", "eval"):
    return True
  if record.get("budget") == "finetune" and record.get("init_from") == "rope":
    return not record["run"].startswith("rope_") or record["run"] == "rope_continued"
  return record.get("run") in ("rope", "nope") and ev["scaling"] == "none"


def _evaluation_label(ev: dict) -> str:
  scaling = ev["scaling"]
  if scaling == "none":
    return "as trained"
  if scaling in ("logn", "llama4"):
    return f"{scaling} query scale at evaluation"
  rope = ev["result"].get("rope_scaling") or {}
  if "ramp" in rope:  # a YaRN ramp of its own (eval.py --rope_beta_fast, --rope_ramp)
    return (
      f"{rope['kind']} at evaluation (factor length / L, beta_fast {rope['beta_fast']:g}, "
      f"beta_slow {rope['beta_slow']:g} rotations over the {rope['ramp']} length)"
    )
  return f"{scaling} at evaluation (factor length / L)"


def _frontier_table(records: Sequence[dict], rows: list[dict], lengths: list[int]) -> list[str]:
  chosen = [(r, ev) for r in records for ev in r.get("evaluations", []) if _is_frontier(r, ev)]
  if not any(r.get("budget") != "full" for r, _ in chosen):
    return []
  lines = ["", "## The 2024-26 options: perplexity, non-overlapping windows", ""]
  lines += ["| run | evaluation | " + " | ".join(str(n) for n in lengths) + " |"]
  lines += ["|---|---|" + "---|" * len(lengths)]
  for r, ev in chosen:
    cells = [
      _fmt(_ppl(rows, run=r["run"], scaling=ev["scaling"], length=n, protocol="nonoverlapping"))
      for n in lengths
    ]
    lines.append(f"| {r['run']} | {_evaluation_label(ev)} | " + " | ".join(cells) + " |")
  return lines


def _protocol_only(result: dict, protocol: str) -> dict:
  return {**result, "records": [r for r in result["records"] if r["protocol"] == protocol]}


def _mlm_curve_table(records: Sequence[dict]) -> list[str]:
  """Validation MLM loss at L at each evaluation step: the curves of the RoFormer Fig. 3."""
  curves = {
    r["run"]: {m["step"]: m["eval_loss"] for m in r.get("metrics", []) if "eval_loss" in m}
    for r in records
  }
  steps = sorted({step for curve in curves.values() for step in curve})
  if not steps:
    return []
  lines = ["", "## Validation MLM loss at L during training (nats)", ""]
  lines += ["| encoding | " + " | ".join(str(n) for n in steps) + " |"]
  lines += ["|---|" + "---|" * len(steps)]
  for run, curve in curves.items():
    if curve:
      cells = [f"{curve[n]:.3f}" if n in curve else "–" for n in steps]
      lines.append(f"| {run} | " + " | ".join(cells) + " |")
  return lines


def write_mlm(
  records: Sequence[dict], out: pathlib.Path, *, seq_len: int, scale: str, draw: bool = True
):
  """results.csv (with accuracy), table.md and (unless not `draw`) curves.png of the MLM grid."""
  rows = []
  for record in records:
    for ev in record.get("evaluations", []):
      for r in ev["result"]["records"]:
        row = {"run": record["run"], "encoding": record["encoding"], "length": r["length"]}
        row["protocol"] = r["protocol"]
        if "skipped" in r:
          row["skipped"] = r["skipped"].split(";")[0]
        else:
          row.update(loss=f"{r['loss']:.6f}", accuracy=f"{r['accuracy']:.6f}", tokens=r["tokens"])
        rows.append(row)
  columns = ("run", "encoding", "length", "protocol", "loss", "accuracy", "tokens", "skipped")
  grid.write_csv(rows, out / "results.csv", columns)
  every_row, records = rows, seeds.seed_zero(records)  # replicates: their own table below
  lengths = sorted({int(r["length"]) for r in rows})
  lines = [f"# Masked-LM comparison ({scale} scale, training length {seq_len})", ""]
  lines += ["Masked-token loss (nats) / accuracy, non-overlapping windows.", ""]
  lines += ["| encoding | " + " | ".join(str(n) for n in lengths) + " |"]
  lines += ["|---|" + "---|" * len(lengths)]
  for record in records:
    if "skipped" in record:
      lines.append(f"| {record['run']} | refused: {record['skipped']} |")
      continue
    cells = []
    for n in lengths:
      row = grid.lookup(rows, run=record["run"], length=n, protocol="nonoverlapping")
      if row is None or "loss" not in row:
        cells.append("skipped" if row else "–")
      else:
        cells.append(f"{float(row['loss']):.3f} / {float(row['accuracy']):.3f}")
    lines.append(f"| {record['run']} | " + " | ".join(cells) + " |")
  lines += _mlm_curve_table(records)
  lines += ["", "## Wall time", ""] + _wall_table(records)
  nonoverlapping = dict(protocol="nonoverlapping")
  lines += seeds.section(
    [
      ("masked-token accuracy", seeds.summary(every_row, value="accuracy", where=nonoverlapping)),
      ("masked-token loss (nats)", seeds.summary(every_row, value="loss", where=nonoverlapping)),
    ]
  ) + [""]
  (out / "table.md").write_text("\n".join(lines))
  if not draw:
    return
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
  for record in records:
    metrics = record.get("metrics", [])
    train = [(m["step"], m["train_loss"]) for m in metrics if "train_loss" in m]
    evals = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    if train:
      ax_train.plot(*zip(*train, strict=True), label=record["run"])
    if evals:
      ax_eval.plot(*zip(*evals, strict=True), marker="o", markersize=3, label=record["run"])
  for ax, title in ((ax_train, "training MLM loss"), (ax_eval, "validation MLM loss at L")):
    ax.set_xlabel("step")
    ax.set_ylabel("masked-token loss (nats)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
  fig.suptitle(f"MLM loss curves ({scale} scale; RoFormer paper Fig. 3)")
  fig.savefig(out / "curves.png", dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  import sys

  from experiments import pages

  pages.main(sys.argv[1:])
