"""The committed results: each grid's CSVs, tables and page (results/<grid>/README.md) are what
`python -m experiments.report results/<grid>` makes from its run JSONs and notes.md, and every
results table the README or a page shows is copied verbatim from one of the grids' tables."""

import csv
import difflib
import json
import re
import shutil

import pytest

from experiments import grid, pages, seeds, synthetic
from roformer.testing import REPO

RESULTS = REPO / "results"
GRIDS = [RESULTS / name for name in pages.GRIDS]
# A table copied from a grid's table.md is announced by this comment on the line before.
TABLE_MARK = re.compile(r"<!-- from (results/\S+/table\.md) -->")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
  """grid directory -> a temporary directory holding its report regenerated from its JSONs
  (once per grid for the whole module: the CSV, table and page tests share it). The plots are
  not drawn: the pages link the committed ones, and drawing them is most of the time."""
  made = {}

  def make(grid_dir):
    if grid_dir not in made:
      out = tmp_path_factory.mktemp(grid_dir.name)
      pages.regenerate(grid_dir, out, draw=False)
      made[grid_dir] = out
    return made[grid_dir]

  return make


def _ids(path):
  return path.name


@pytest.mark.parametrize("grid_dir", GRIDS, ids=_ids)
def test_committed_csvs_and_tables_are_what_the_run_jsons_give(grid_dir, regenerated):
  out = regenerated(grid_dir)
  for scale in pages.scales(grid_dir):
    for name in ("results.csv", "tasks.csv", "table.md"):
      regenerated_file, committed = out / scale / name, grid_dir / scale / name
      where = committed.relative_to(REPO)
      assert regenerated_file.exists() == committed.exists(), where  # tasks.csv: both or neither
      if committed.exists():
        assert regenerated_file.read_text() == committed.read_text(), (
          f"{where} is not what its run JSONs give: rerun `{pages.command(grid_dir.name)}`"
        )


@pytest.mark.parametrize("grid_dir", GRIDS, ids=_ids)
def test_committed_page_is_what_the_run_jsons_and_notes_give(grid_dir, regenerated):
  page = regenerated(grid_dir) / "README.md"
  committed = grid_dir / "README.md"
  command = pages.command(grid_dir.name)
  assert committed.exists(), f"no {committed.relative_to(REPO)}: run `{command}`"
  made, kept = page.read_text().splitlines(), committed.read_text().splitlines()
  diff = difflib.unified_diff(kept, made, "committed", "from the JSONs", lineterm="")
  diff = "\n".join(list(diff)[:20])
  assert page.read_text() == committed.read_text(), (
    f"{committed.relative_to(REPO)} is not what its run JSONs and notes.md give: rerun "
    f"`{command}`\n{diff}"
  )


def _check_marked_tables(path) -> int:
  """Asserts every table after a mark is rows of the marked table.md; returns how many marks."""
  lines = path.read_text().splitlines()
  marked = [(i, m.group(1)) for i, line in enumerate(lines) if (m := TABLE_MARK.search(line))]
  for index, source in marked:
    table = set((REPO / source).read_text().splitlines())
    rows = []
    for line in lines[index + 1 :]:
      if not line.startswith("|"):
        if rows:
          break
        continue
      rows.append(line)
    assert len(rows) > 2, f"{path.name} line {index + 1}: no table after the mark"
    for row in rows:
      assert row in table, f"{path.relative_to(REPO)}: row not in {source}: {row}"
  return len(marked)


def test_readme_results_tables_are_copied_from_the_committed_tables():
  # "Results at a glance" shows one table, marked and copied from a grid's table.md.
  assert _check_marked_tables(REPO / "README.md") > 0, "README: its results table has no mark"


@pytest.mark.parametrize("grid_dir", GRIDS, ids=_ids)
def test_page_tables_are_copied_from_the_committed_tables(grid_dir):
  assert _check_marked_tables(grid_dir / "README.md") > 0, f"{grid_dir.name}: a page with no table"


def _mlm_copy(tmp_path, notes: str):
  """A copy of the committed MLM grid (JSONs and tables) with `notes` as its notes.md."""
  root = tmp_path / "results"
  shutil.copytree(RESULTS / "mlm", root / "mlm", ignore=shutil.ignore_patterns("*.png"))
  (root / "mlm" / "notes.md").write_text(notes)
  return root / "mlm"


def test_page_numbers_are_read_from_the_run_jsons(tmp_path):
  source = _mlm_copy(tmp_path, "# MLM\n\nRoPE at L: {{loss pystdlib rope 128}} nats.\n")
  path = source / "pystdlib" / "rope.json"
  record = json.loads(path.read_text())
  scored = record["evaluations"][0]["result"]["records"]
  at_l = next(r for r in scored if r["length"] == 128 and r["protocol"] == "nonoverlapping")
  assert f"RoPE at L: {at_l['loss']:.3f} nats." in pages.render_page(source, source)
  at_l["loss"] = 1.25
  path.write_text(json.dumps(record))
  assert "RoPE at L: 1.250 nats." in pages.render_page(source, source)


@pytest.mark.parametrize(
  "notes, error",
  [
    ("# MLM\n\n{{lost pystdlib rope 128}}\n", "line 3: unknown value 'lost'"),
    ("# MLM\n\n{{loss pystdlib rope 999}}\n", "line 3: pystdlib: rope has no score at 999"),
    ("# MLM\n\nx\n{{table pystdlib No such}}\n", "line 4: pystdlib/table.md has no heading"),
    ("# MLM\n\n![curves](pystdlib/missing.png)\n", "line 3: no file pystdlib/missing.png"),
  ],
)
def test_a_page_that_cannot_be_made_names_its_notes_line(tmp_path, notes, error):
  source = _mlm_copy(tmp_path, notes)
  with pytest.raises(ValueError, match=re.escape(error)):
    pages.render_page(source, source)


def test_a_driver_refreshes_the_page_of_a_committed_grid_only():
  assert pages.page_of(RESULTS / "mlm" / "pystdlib") == RESULTS / "mlm"
  assert pages.page_of(RESULTS / "synthetic") == RESULTS / "synthetic"
  assert pages.page_of(RESULTS / "mlm") is None  # a scaled grid's driver writes a corpus folder
  assert pages.page_of(REPO / "tmp_out" / "pystdlib") is None


def test_report_command_refuses_a_directory_that_is_not_a_grid(tmp_path):
  with pytest.raises(SystemExit, match="not a grid directory"):
    pages.main([str(tmp_path)])


def test_extrapolation_csv_has_the_documented_columns():
  for directory in sorted((RESULTS / "extrapolation").glob("*/results.csv")):
    with directory.open() as f:
      header = next(csv.reader(f))
    assert header == list(grid.CSV_COLUMNS)


SYNTHETIC = RESULTS / "synthetic"


def test_committed_synthetic_results_are_the_whole_cpu_grid():
  expected = {
    synthetic.file_stem(synthetic.run_name(*run)) + ".json"
    for run in synthetic.grid_runs(synthetic.SCALES["cpu"])
  }
  # Seed replicates (`--seeds`, `<run>-seed<k>.json`) come beside the grid's own runs.
  grid_files = {p.name for p in SYNTHETIC.glob("*.json") if seeds.split_name(p.stem)[1] == 0}
  assert grid_files == expected
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
