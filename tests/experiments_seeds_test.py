"""experiments/seeds.py: `--seeds` replicates of a grid's runs, how reports find them, and their
mean and spread."""

import csv
import json
import statistics

import pytest

from experiments import grid, report, seeds


def _runs():
  at_l = [grid.Eval("none", {"lengths": [16]})]
  return [
    grid.Run("rope", "rope", {"posenc.kind": "rope"}, at_l),
    grid.Run("rope_short_seed1", "rope", {"train.seed": 1}, at_l, budget="seed"),
    grid.Run("rope_2x", "rope", {"data.seq_len": 32}, at_l, init_from="rope", budget="finetune"),
    grid.Run("rope_yarn", "rope", {}, at_l, eval_of="rope", budget="eval"),
    grid.Run("nope_enc", "nope", {}, at_l, skip_reason="NoPE needs a decoder"),
  ]


def test_replicates_differ_from_their_seed_0_run_by_the_seed_alone():
  runs = seeds.replicate(_runs(), 3)
  names = [r.name for r in runs]
  assert names[:5] == [r.name for r in _runs()]  # seed 0: the grid as defined, first
  assert names[5:] == [
    "rope-seed1", "rope_short_seed1-seed1", "rope_2x-seed1", "rope_yarn-seed1",
    "rope-seed2", "rope_short_seed1-seed2", "rope_2x-seed2", "rope_yarn-seed2",
  ]  # fmt: skip
  by_name = {r.name: r for r in runs}
  assert by_name["rope-seed2"].overrides == {"posenc.kind": "rope", "train.seed": 2}
  # A run that sets its own seed is raised from it; the grid's `_seed1` run is a run of its own.
  assert by_name["rope_short_seed1-seed1"].overrides == {"train.seed": 2}
  # A fine-tune starts from its parent's replicate; an evaluation-only run evaluates it and
  # takes its config (seed included) from it.
  fine = by_name["rope_2x-seed1"]
  assert fine.init_from == "rope-seed1" and fine.overrides["train.seed"] == 1
  evaluated = by_name["rope_yarn-seed2"]
  assert evaluated.eval_of == "rope-seed2" and "train.seed" not in evaluated.overrides
  # Every replicate's parent runs before it.
  order = {name: i for i, name in enumerate(names)}
  assert all(
    order[r.init_from or r.eval_of] < order[r.name] for r in runs if r.init_from or r.eval_of
  )
  assert seeds.replicate(_runs(), 1) == _runs()


@pytest.mark.parametrize("text, message", [("0", ">= 1"), ("two", "whole number"), ("-1", ">= 1")])
def test_seeds_count_is_refused_when_not_a_positive_whole_number(text, message):
  with pytest.raises(ValueError, match=message):
    seeds.parse_count(text)


def test_split_name_reads_replicates_only():
  assert seeds.split_name("rope-seed12") == ("rope", 12)
  assert seeds.split_name("rope_short_seed1") == ("rope_short_seed1", 0)
  assert seeds.split_name("rope-seed0") == ("rope-seed0", 0)  # replicate 0 is the run itself


def _record(name, ppl_by_length):
  records = [
    {"length": n, "protocol": p, "loss": 1.0, "ppl": v, "tokens": 64}
    for n, v in ppl_by_length.items()
    for p in ("nonoverlapping", "sliding")
  ]
  return {
    "run": name, "encoding": "rope", "budget": "full",
    "evaluations": [{"scaling": "none", "result": {"records": records}}],
  }  # fmt: skip


def test_summary_gives_mean_spread_and_range_per_length_of_replicated_runs_only():
  records = [
    _record("rope", {16: 4.0, 32: 8.0}),
    _record("rope-seed1", {16: 5.0, 32: 9.0}),
    _record("rope-seed2", {16: 9.0, 32: 13.0}),
    _record("alibi", {16: 3.0, 32: 3.5}),  # one seed: no row
  ]
  lines = seeds.summary(grid.csv_rows(records), value="ppl", where={"protocol": "nonoverlapping"})
  assert lines[0] == "| run | seeds | 16 | 32 |"
  sd = statistics.stdev([4.0, 5.0, 9.0])  # 2.6458
  assert (
    lines[2]
    == f"| rope | 3 | 6.000 ± {sd:.3f} [4.000, 9.000] | 10.000 ± {sd:.3f} [8.000, 13.000] |"
  )
  assert len(lines) == 3
  # Negative control: without replicates there is no table (and no section in table.md).
  assert seeds.summary(grid.csv_rows(records[3:]), value="ppl") == []


def test_reports_read_replicates_with_their_runs_and_table_them_apart(tmp_path):
  runs = [grid.Run("rope", "rope", {}, []), grid.Run("alibi", "alibi", {}, [])]
  for name, values in (
    ("rope", {16: 4.0}), ("alibi", {16: 3.0}), ("rope-seed2", {16: 6.0}), ("rope-seed1", {16: 5.0}),
    ("rope_other", {16: 1.0}), ("rope_other-seed1", {16: 1.0}),  # another run's replicate
  ):  # fmt: skip
    (tmp_path / f"{name}.json").write_text(json.dumps(_record(name, values)))
  records = grid.finished_records(runs, tmp_path)
  assert [r["run"] for r in records] == ["rope", "rope-seed1", "rope-seed2", "alibi"]
  report.write_extrapolation(records, tmp_path, seq_len=16, scale="tiny", draw=False)
  table = (tmp_path / "table.md").read_text()
  _, seeds_part = table.split("## Seed replicates: perplexity, non-overlapping")
  assert "| rope | 3 | 5.000 ± 1.000 [4.000, 6.000] |" in seeds_part and "alibi" not in seeds_part
  # The grid's own tables show seed 0 only; results.csv has every run.
  assert "rope-seed1" not in table
  assert "rope-seed1,rope" in (tmp_path / "results.csv").read_text()
  # Negative control: without replicates table.md has no such section.
  report.write_extrapolation(
    records[:1] + records[3:], tmp_path, seq_len=16, scale="tiny", draw=False
  )
  assert "Seed replicates" not in (tmp_path / "table.md").read_text()


def test_synthetic_replicates_train_with_their_seed_from_their_seed_s_parent():
  from experiments import synthetic

  scale = synthetic.SCALES["cpu"]
  rope = synthetic.run_config(scale, "copy", "rope", False, "/w")
  rope1 = synthetic.run_config(scale, "copy", "rope", False, "/w", seed=1)
  assert (rope.train.seed, rope1.train.seed) == (0, 1)
  assert rope1.model == rope.model and rope1.data == rope.data
  assert synthetic.run_name("copy", "rope", True, 2) == "copy/rope+randomized-seed2"
  workdir1 = synthetic.run_workdir(scale, "copy", "rope", False, "/w", seed=1)
  assert workdir1.name.startswith("copy__rope-seed1-")
  assert workdir1 != synthetic.run_workdir(scale, "copy", "rope", False, "/w")
  # DroPE's replicate continues the RoPE replicate of its seed; an evaluation arm scores it.
  drope1 = synthetic.run_config(scale, "copy", "drope", False, "/w", seed=1)
  assert drope1.train.init_from == str(workdir1) and drope1.train.seed == 1
  assert synthetic.run_workdir(scale, "copy", "rope_logn", False, "/w", seed=1) == workdir1


def test_synthetic_tables_show_seed_0_and_replicates_in_their_own_table(tmp_path):
  from experiments import synthetic

  def result(seed, em):
    records = [{"length": n, "exact_match": em, "token_accuracy": em} for n in (4, 8)]
    return {
      "run": synthetic.run_name("copy", "rope", False, seed), "task": "copy", "encoding": "rope",
      "randomized": False, "train_lengths": [4, 8], "records": records,
    }  # fmt: skip

  synthetic.write_summaries(str(tmp_path), [result(0, 0.5), result(1, 0.7)], draw=False)
  table = (tmp_path / "table.md").read_text()
  head, replicates = table.split("## Seed replicates: copy, exact match")
  assert head.count("| rope | no |") == 2  # exact match and per-token tables: seed 0 only
  assert "| rope | no | 0.50 | 0.50 |" in head
  sd = statistics.stdev([0.5, 0.7])
  assert f"| copy/rope | 2 | 0.600 ± {sd:.3f} [0.500, 0.700] | 0.600 ± {sd:.3f}" in replicates
  rows = list(csv.DictReader(open(tmp_path / "results.csv")))
  assert [r["seed"] for r in rows] == ["0", "0", "1", "1"]


def test_summary_keeps_a_run_s_evaluations_apart():
  def record(name, ppl_none, ppl_yarn):
    rows = lambda v: [
      {"length": 32, "protocol": "nonoverlapping", "loss": 1.0, "ppl": v, "tokens": 8}
    ]  # noqa: E731
    return {
      "run": name, "encoding": "rope",
      "evaluations": [
        {"scaling": "none", "result": {"records": rows(ppl_none)}},
        {"scaling": "yarn", "result": {"records": rows(ppl_yarn)}},
      ],
    }  # fmt: skip

  rows = grid.csv_rows([record("rope", 20.0, 8.0), record("rope-seed1", 22.0, 9.0)])
  lines = seeds.summary(rows, value="ppl", by=("scaling",))
  assert lines[2].startswith("| rope | 2 | 21.000 ± 1.414 [20.000, 22.000] |")
  assert lines[3].startswith("| rope (yarn) | 2 | 8.500 ± 0.707 [8.000, 9.000] |")
  # Negative control: without `by` the two evaluations would be one (and wrong) line.
  assert len(seeds.summary(rows, value="ppl")) == 3
