"""The committed results: each grid's CSV and table are what its runs' JSONs give, and every
results table in the README is copied verbatim from one of those tables."""

import csv
import json
import re

import pytest

from experiments import extension, extension_report, extrapolation, grid, mlm, report, synthetic
from roformer.testing import REPO

RESULTS = REPO / "results"
GRID_DIRS = sorted(p.parent for p in RESULTS.glob("*/*/table.md") if p.parts[-3] != "synthetic")
# A README table copied from a grid's table.md is announced by this comment on the line before.
TABLE_MARK = re.compile(r"<!-- from (results/\S+/table\.md) -->")


def _regenerate(directory, tmp_path):
  """Rewrites OUT's report from its JSONs into tmp_path, as the driver does after each run."""
  scale, seq_len = report.read_header(directory)
  if directory.parent.name == "extension":
    runs = extension.perplexity_runs(extrapolation.SCALES[scale], set())
    task_scale = extension.TASK_SCALES[scale]
    tasks = {
      task: grid.finished_records(extension.task_runs(task_scale, task, set()), directory / "tasks")
      for task in task_scale.tasks
    }
    records = grid.finished_records(runs, directory)
    assert records, f"{directory}: no run JSONs"
    extension_report.write_extension(records, tasks, tmp_path, seq_len=seq_len, scale=scale)
    return
  if directory.parent.name == "extrapolation":
    runs = extrapolation.grid_runs(extrapolation.SCALES[scale], set())
    write = report.write_extrapolation
  else:
    runs = mlm.grid_runs(mlm.SCALES[scale], set())
    write = report.write_mlm
  records = grid.finished_records(runs, directory)
  assert records, f"{directory}: no run JSONs"
  write(records, tmp_path, seq_len=seq_len, scale=scale)


@pytest.mark.parametrize("directory", GRID_DIRS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_csv_and_table_are_what_the_run_jsons_give(directory, tmp_path):
  _regenerate(directory, tmp_path)
  for name in ("results.csv", "tasks.csv", "table.md"):
    regenerated, committed = tmp_path / name, directory / name
    assert regenerated.exists() == committed.exists(), name  # tasks.csv: both or neither
    if committed.exists():
      assert regenerated.read_text() == committed.read_text(), name


def test_readme_results_tables_are_copied_from_the_committed_tables():
  lines = (REPO / "README.md").read_text().splitlines()
  marked = [(i, m.group(1)) for i, line in enumerate(lines) if (m := TABLE_MARK.search(line))]
  assert marked, "README has no results table marked with <!-- from results/.../table.md -->"
  for index, source in marked:
    table = set((REPO / source).read_text().splitlines())
    rows = []
    for line in lines[index + 1 :]:
      if not line.startswith("|"):
        if rows:
          break
        continue
      rows.append(line)
    assert len(rows) > 2, f"README line {index + 1}: no table after the mark"
    for row in rows:
      assert row in table, f"README row not in {source}: {row}"


def test_extrapolation_csv_has_the_documented_columns():
  for directory in GRID_DIRS:
    if directory.parent.name != "extrapolation":
      continue
    with (directory / "results.csv").open() as f:
      header = next(csv.reader(f))
    assert header == list(grid.CSV_COLUMNS)


SYNTHETIC = RESULTS / "synthetic"


def test_committed_synthetic_results_are_the_whole_cpu_grid():
  expected = {
    synthetic.file_stem(synthetic.run_name(*run)) + ".json"
    for run in synthetic.grid_runs(synthetic.SCALES["cpu"])
  }
  assert {p.name for p in SYNTHETIC.glob("*.json")} == expected
  # Runs trained under other settings would not be one grid: every JSON holds the settings
  # the driver gives its run today (so a rerun of the grid skips it rather than mixing).
  for task, encoding, randomized in synthetic.grid_runs(synthetic.SCALES["cpu"]):
    name = synthetic.file_stem(synthetic.run_name(task, encoding, randomized))
    record = json.loads((SYNTHETIC / f"{name}.json").read_text())
    scale = synthetic.SCALES["cpu"]
    # Paths are recorded relative to the workroot ($WORKROOT), so any root gives the same.
    settings = synthetic.run_settings(scale, task, encoding, randomized, "/any/workroot")
    assert grid._changed_fields(record["settings"], settings) == [], name
    assert record["embed_scale"] == "sqrt_d", name
    # Runs recorded before evaluations wrote their protocol were all scored at 0, 1, 2, ...
    protocol = record.get("positions", {"kind": "consecutive"})
    assert protocol["kind"] == ("randomized" if randomized else "consecutive"), name
  heatmaps = {p.name for p in SYNTHETIC.glob("passkey_heatmap__*.png")}
  assert heatmaps == {
    n.replace("passkey__", "passkey_heatmap__").replace(".json", ".png")
    for n in expected
    if n.startswith("passkey__")
  }


def test_committed_synthetic_csv_and_table_are_what_the_run_jsons_give(tmp_path):
  for path in SYNTHETIC.glob("*.json"):
    (tmp_path / path.name).write_text(path.read_text())
  synthetic.summarize(str(tmp_path))
  for name in ("results.csv", "table.md"):
    assert (tmp_path / name).read_text() == (SYNTHETIC / name).read_text(), name
