"""The reproduction grids at --scale=tiny: every output file, and a rerun that resumes."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from roformer.testing import REPO


def _run(grid_name, out, workroot, *extra):
  """`python -m experiments.<grid_name> --scale=tiny` from the repository root."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", f"experiments.{grid_name}", "--scale=tiny", f"--out={out}",
     f"--workroot={workroot}", *extra],
    cwd=REPO, capture_output=True, text=True, env=env, timeout=900, check=False,
  )  # fmt: skip


def test_the_extrapolation_grid_plans_every_run():
  from experiments import extrapolation

  runs = {run.name for run in extrapolation.grid_runs(extrapolation.SCALES["tiny"], set())}
  encodings = {"sinusoidal", "learned", "t5", "alibi", "rope", "xpos", "nope"}
  seeds = {"rope_short_seed1", "sinusoidal_short_seed1", "learned_short_seed1"}
  fine_tunes = {"rope_linear_2x", "rope_yarn_2x"}
  frontier = {
    "irope", "rnope_swa", "qk_norm", "qk_norm_whole", "ssmax", "pope", "resonance", "fox", "sinks"
  }  # fmt: skip
  recalibrations = {"drope", "rope_continued"}
  evaluated = {"rope_logn", "nope_logn", "nope_llama4"}
  evaluated |= {"rope_yarn_authors", "resonance_yarn_authors"}
  assert runs == (
    encodings | {f"{e}_short" for e in encodings} | seeds | fine_tunes | frontier
    | recalibrations | evaluated
  )  # fmt: skip


# One run of each kind of the grid's (trained in two pieces, each reported with the other's):
# learned positions (no row past their table) with their short run and its seed; RoPE with its
# scalings at evaluation, short run, seed, fine-tunes and query temperature; xPos with and
# without BCA; a 2024-26 arm also scored with YaRN; a recalibration continuing RoPE's run.
# `test_the_extrapolation_grid_plans_every_run` holds the whole plan.
PIECES = ("learned", "rope,xpos,resonance,drope")


@pytest.mark.slow
def test_extrapolation_grid_writes_every_output_and_resumes(tmp_path):
  out, workroot = tmp_path / "out", tmp_path / "runs"
  for only in PIECES:
    proc = _run("extrapolation", out, workroot, f"--only={only}")
    assert proc.returncode == 0, proc.stderr[-3000:]
  runs = {p.stem for p in out.glob("*.json")}
  assert runs == {
    "learned", "learned_short", "learned_short_seed1", "rope", "rope_short", "rope_short_seed1",
    "rope_linear_2x", "rope_yarn_2x", "rope_logn", "xpos", "xpos_short", "resonance", "drope",
    "rope_yarn_authors", "resonance_yarn_authors",
  }  # fmt: skip
  seed_run = json.loads((out / "rope_short_seed1.json").read_text())
  assert seed_run["overrides"]["train.seed"] == 1
  for name in ("results.csv", "table.md", "encodings.png", "scalings.png", "frontier.png"):
    assert (out / name).stat().st_size > 0, name
  with (out / "results.csv").open() as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == [
    "run",
    "encoding",
    "scaling",
    "length",
    "protocol",
    "loss",
    "ppl",
    "tokens",
  ]
  # Both pieces are reported.
  assert {r["run"] for r in rows} == runs
  assert {r["scaling"] for r in rows if r["run"] == "rope"} == {
    "none", "linear", "ntk", "dynamic", "yarn", "llama3"
  }  # fmt: skip
  assert {r["scaling"] for r in rows if r["run"] == "xpos"} == {"none", "bca"}
  # Learned positions have no row past their table; every other encoding reaches 2L.
  assert max(int(r["length"]) for r in rows if r["run"] == "learned") == 16
  assert max(int(r["length"]) for r in rows if r["run"] == "rope") == 32
  fine_tune = json.loads((out / "rope_yarn_2x.json").read_text())
  # The source run's workdir: its name and its settings hash.
  assert re.search(r"/rope-[0-9a-f]{10}$", fine_tune["overrides"]["train.init_from"])
  assert fine_tune["settings"]["train.init_from"].startswith("$WORKROOT/rope-")
  table = (out / "table.md").read_text()
  assert "xpos (no BCA)" in table and "| learned | " in table.split("## Seed noise")[1]
  # DroPE: the rope run continued without positions; rope_logn: rope's checkpoint evaluated
  # with a query temperature, nothing trained.
  drope = json.loads((out / "drope.json").read_text())
  assert drope["settings"]["posenc.kind"] == "nope" and drope["init_from"] == "rope"
  rope_logn = json.loads((out / "rope_logn.json").read_text())
  assert rope_logn["eval_of"] == "rope" and rope_logn["train_seconds"] == 0.0
  assert rope_logn["evaluations"][0]["result"]["query_scale"] == "logn"
  assert rope_logn["metrics"] == []
  frontier_rows = table.split("## The 2024-26 options")[1]
  for name in ("resonance", "drope", "rope_logn"):
    assert f"| {name} | " in frontier_rows, name
  assert "| resonance | yarn at evaluation" in frontier_rows
  # (Resonance) YaRN as the Resonance authors' from-scratch code: the resonance checkpoint
  # (and rope's), YaRN with beta_fast 2 counted over each evaluated length.
  authors = json.loads((out / "resonance_yarn_authors.json").read_text())
  assert authors["eval_of"] == "resonance" and authors["train_seconds"] == 0.0
  assert authors["evaluations"][0]["result"]["rope_scaling"] == {
    "kind": "yarn", "factor": "auto", "beta_fast": 2.0, "beta_slow": 1.0, "ramp": "evaluated"
  }  # fmt: skip
  assert (
    "| resonance_yarn_authors | yarn at evaluation (factor length / L, beta_fast 2, beta_slow 1 "
    "rotations over the evaluated length) |" in frontier_rows
  )
  # A rerun finds every run done and only rewrites the report.
  rerun = _run("extrapolation", out, workroot, f"--only={','.join(PIECES)}")
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert rerun.stdout.count("done (skipped)") == len(runs)
  # Retraining a run from its recorded overrides gives its recorded eval loss.
  again = subprocess.run(
    [sys.executable, "-m", "experiments.rerun", str(out / "rope_short.json"),
     f"--workdir={tmp_path / 'again'}"],
    cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=600,
  )  # fmt: skip
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
  assert "rope_short: recorded eval loss" in again.stdout
  # A run started from a run whose workdir is gone (another machine's cache) retrains it first,
  # to the recorded loss.
  (rope_workdir,) = workroot.glob("rope-*")
  subprocess.run(["rm", "-r", str(rope_workdir)], check=True)
  (out / "drope.json").unlink()
  resumed = _run("extrapolation", out, workroot, "--only=drope")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "rope: its workdir" in resumed.stdout and "retraining it" in resumed.stdout
  diff = re.search(r"rope: final eval loss \S+, recorded \S+ \(diff (\S+)\)", resumed.stdout)
  assert diff and abs(float(diff.group(1))) < 1e-4, resumed.stdout[-2000:]
  assert json.loads((out / "drope.json").read_text())["settings"] == drope["settings"]


@pytest.mark.slow
def test_mlm_grid_writes_every_output_and_records_refused_encodings(tmp_path):
  out = tmp_path / "out"
  # Learned positions (no row past their table), RoPE, and NoPE, which the encoder refuses.
  proc = _run("mlm", out, tmp_path / "runs", "--only=learned,rope,nope")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("results.csv", "table.md", "curves.png"):
    assert (out / name).stat().st_size > 0, name
  nope = json.loads((out / "nope.json").read_text())
  assert "causal-only" in nope["skipped"]
  rope = json.loads((out / "rope.json").read_text())
  assert any("eval_loss" in m for m in rope["metrics"])
  with (out / "results.csv").open() as f:
    rows = list(csv.DictReader(f))
  learned = {int(r["length"]): r for r in rows if r["run"] == "learned"}
  assert learned[16]["accuracy"] and learned[32]["skipped"]
  assert all(r["accuracy"] for r in rows if r["run"] == "rope")


def _fake_training(monkeypatch, last_step):
  """train_and_evaluate replaced by one that logs training up to `last_step`, as a signal would."""
  from roformer.train import loop as train_loop

  def train_and_evaluate(config, workdir):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      for step in range(1, last_step + 1):
        f.write(json.dumps({"step": step, "train_loss": 1.0}) + "\n")
    return {}

  monkeypatch.setattr(train_loop, "train_and_evaluate", train_and_evaluate)


def test_a_run_stopped_before_its_last_step_ends_the_grid_instead_of_being_scored(
  tmp_path, monkeypatch
):
  from experiments import synthetic

  scale = synthetic.SCALES["tiny"]
  steps = scale.train["num_train_steps"]
  config = synthetic.run_config(scale, "copy", "rope", False)
  evaluated = []
  monkeypatch.setattr(
    "roformer.evals.task_vs_length.evaluate_tasks",
    lambda *a, **k: evaluated.append(a) or ({}, None),
  )
  _fake_training(monkeypatch, last_step=steps - 1)
  with pytest.raises(SystemExit, match=f"copy/rope stopped at step {steps - 1}"):
    synthetic.run_one(scale, "copy", "rope", False, config, str(tmp_path / "stopped"))
  assert evaluated == []

  _fake_training(monkeypatch, last_step=steps)
  record = synthetic.run_one(scale, "copy", "rope", False, config, str(tmp_path / "finished"))
  assert len(evaluated) == 1 and record["run"] == "copy/rope"


def test_ctrl_c_in_a_grid_is_one_line_naming_the_finished_runs(tmp_path, capsys, monkeypatch):
  from experiments import progress

  (tmp_path / "copy__rope.json").write_text("{}")
  with pytest.raises(SystemExit) as stopped, progress.stop_on_ctrl_c(tmp_path):
    raise KeyboardInterrupt
  assert stopped.value.code == 130
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "1 finished runs" in err and "(copy__rope)" in err
  assert "rerun the same command to resume" in err


def test_reports_of_runs_finished_within_a_minute_are_one_and_ctrl_c_writes_the_last(
  monkeypatch,
):
  from experiments import progress

  now, written = [1000.0], []
  monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
  report = progress.ThrottledReport(written.append)
  report(["a"])  # the first at once
  now[0] += 30
  report(["a", "b"])  # within the minute: pending
  assert written == [["a"]]
  now[0] += 31
  report(["a", "b", "c"])  # the minute passed: the latest records
  assert written == [["a"], ["a", "b", "c"]]
  now[0] += 1
  report(["a", "b", "c", "d"])
  with pytest.raises(KeyboardInterrupt), report.flushed_on_error():
    raise KeyboardInterrupt
  assert written[-1] == ["a", "b", "c", "d"]
  with report.flushed_on_error():  # nothing pending: nothing written
    pass
  assert len(written) == 3


def test_the_workdir_a_run_starts_from_counts_by_its_run_not_its_settings_hash():
  # The parent's hash moves when a config field is added (its own record checks its settings).
  from experiments import grid

  recorded = {"train.init_from": "$WORKROOT/copy__rope-1bb1d3474c", "train.seed": 0}
  today = {"train.init_from": "$WORKROOT/copy__rope-6eaa303b66", "train.seed": 0}
  assert grid._changed_fields(recorded, today) == []
  other = dict(today, **{"train.init_from": "$WORKROOT/copy__fire-6eaa303b66"})
  assert grid._changed_fields(recorded, other) == [
    "train.init_from: '$WORKROOT/copy__rope-1bb1d3474c' -> '$WORKROOT/copy__fire-6eaa303b66'"
  ]
  outside = dict(today, **{"train.init_from": "/elsewhere/copy__rope-6eaa303b66"})
  assert len(grid._changed_fields(recorded, outside)) == 1


def test_a_finished_run_keeps_its_recorded_workdir_when_fields_were_added_since(
  tmp_path, monkeypatch
):
  # A record written before a config field existed matches today's settings (the new field is at
  # its default), but today's settings hash differs: the run's workdir, and what a fine-tune
  # starting from it records as train.init_from, are the recorded ones.
  from experiments import grid

  common = {"train.num_train_steps": 2, "data.source": "pystdlib"}
  parent = grid.Run("a", "rope", {}, [])
  child = grid.Run("b", "rope", {}, [], init_from="a", budget="finetune")
  out, workroot = tmp_path / "out", tmp_path / "runs"
  out.mkdir()
  today = grid.run_settings(grid.make_config("", common), [], workroot=workroot)
  older = {k: v for k, v in today.items() if k != "posenc.pope_bias_init"}
  assert grid.settings_hash(older) != grid.settings_hash(today)
  record = {"run": "a", "final_eval": {"loss": 1.0}, "settings": older}
  (out / "a.json").write_text(json.dumps({**record, "settings_hash": grid.settings_hash(older)}))
  recorded_workdir = workroot / grid.workdir_name("a", older)
  trained = []

  def train_to_end(name, config, workdir):
    trained.append((name, config.train.init_from))
    os.makedirs(workdir, exist_ok=True)
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 2, "train_loss": 1.0}) + "\n")
    return {"loss": 1.0}

  monkeypatch.setattr(grid, "train_to_end", train_to_end)
  grid.run_grid([parent, child], base="", common=common, out=out, workroot=workroot)
  # The parent's recorded workdir had no checkpoint: it was retrained there, then b started.
  assert trained == [("a", ""), ("b", str(recorded_workdir))]
  assert (recorded_workdir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_extension_grid_scores_each_method_by_perplexity_and_task_and_resumes(tmp_path):
  out, workroot = tmp_path / "out", tmp_path / "runs"
  only = ("--only=yarn,dca,sinks,window", "--tasks=passkey")
  proc = _run("extension", out, workroot, *only)
  assert proc.returncode == 0, proc.stderr[-3000:]
  names = {"yarn", "dca", "sinks", "window"}
  assert {p.stem for p in out.glob("*.json")} == {"rope"} | {f"rope_{m}" for m in names}
  assert {p.stem for p in (out / "tasks").glob("*.json")} == {"passkey"} | {
    f"passkey_{m}" for m in names
  }
  for name in ("results.csv", "tasks.csv", "table.md", "perplexity.png", "passkey.png"):
    assert (out / name).stat().st_size > 0, name
  dca = json.loads((out / "rope_dca.json").read_text())
  assert dca["eval_of"] == "rope" and dca["train_seconds"] == 0.0
  # Training length 16: DCA's local window L/8 = 2, chunks of 3L/4 - L/8 = 10, its factor's L.
  extension = dca["evaluations"][0]["result"]["context_extension"]
  assert (extension["chunk"], extension["local"], extension["train_len"]) == (10, 2, 16)
  with (out / "tasks.csv").open() as f:
    rows = list(csv.DictReader(f))
  assert {r["method"] for r in rows} == {"plain"} | names
  task_sinks = json.loads((out / "tasks" / "passkey_sinks.json").read_text())
  assert task_sinks["evaluations"][0]["result"]["context_extension"]["kind"] == "sinks"
  table = (out / "table.md").read_text()
  assert "| dca | chunk 10, local 2, train_len 16 |" in table and "## passkey: exact match" in table
  rerun = _run("extension", out, workroot, *only)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert rerun.stdout.count("done (skipped)") == 10


@pytest.mark.slow
def test_extension_grid_on_a_pretrained_decoder_scores_each_method(tmp_path):
  from tests.e2e.eval_extend_test import _hf_dir

  model = _hf_dir(tmp_path)
  config = json.loads((model / "config.json").read_text())
  config["max_position_embeddings"] = 16  # L: the methods' settings and lengths 16..256
  (model / "config.json").write_text(json.dumps(config))
  out = tmp_path / "out"
  args = [f"--hf_model={model}", f"--data_files={tmp_path / 'text' / '*.txt'}", "--max_tokens=256"]
  args.append(f"--out={out}")

  def run(*extra):  # no --scale or --workroot: the grid's flags are refused with --hf_model
    return subprocess.run(
      [sys.executable, "-m", "experiments.extension", *extra], cwd=REPO, capture_output=True,
      text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900, check=False,
    )  # fmt: skip

  proc = run(*args, "--only=plain,yarn,self_extend")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {p.stem for p in out.glob("hf_*.json")} == {"hf_plain", "hf_yarn", "hf_self_extend"}
  self_extend = json.loads((out / "hf_self_extend.json").read_text())
  result = self_extend["evaluations"][0]["result"]
  # W = L/4 = 4; G the smallest keeping grouped distances under L: 255 // 22 + 4 - 0 = 15.
  assert result["context_extension"]["window"] == 4 and result["context_extension"]["group"] == 22
  assert [r["length"] for r in result["records"]] == [16, 32, 64, 128, 256]
  table = (out / "table.md").read_text()
  assert "| self_extend | window 4, group 22 |" in table
  # The fixture's own llama3 scaling is what "plain" evaluates.
  assert "| plain | as trained (llama3, factor 8.0) |" in table
  again = run(*args, "--only=yarn,dca")
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("done (skipped)") == 1  # yarn; dca is new
  table = (out / "table.md").read_text()
  assert all(f"| {m} | " in table for m in ("plain", "yarn", "self_extend", "dca"))
  missing = run(f"--hf_model={model}", f"--out={out}")
  assert missing.returncode != 0 and "--data_files" in missing.stderr
  foreign = run(*args, "--tasks=passkey")
  assert foreign.returncode != 0 and "--tasks: not read with --hf_model" in foreign.stderr


def test_extension_settings_keep_every_method_inside_the_training_length():
  from experiments import extension
  from roformer.evals import spec

  for L, longest in ((16, 32), (16, 256), (83, 530), (128, 2048), (131, 579), (4096, 65536)):
    options = extension.methods(L, longest)
    fields = options["self_extend"]["extend_fields"]
    W, G = fields["window"], fields["group"]
    farthest = [(longest - 1) // g + W - W / g for g in (G, max(1, G - 1))]  # grouped distance
    assert farthest[0] <= L - 1 and (G == 1 or farthest[1] > L - 1), (L, longest, G)
    for kind in ("dca", "dca_paper"):
      dca = options[kind]["extend_fields"]
      assert dca["chunk"] + dca["local"] <= 3 * L // 4  # no query sits past 3L/4
    assert options["sinks"]["extend_fields"]["window"] + extension.SINKS == max(L, 5)
    for kwargs in options.values():  # every one a valid evaluation
      spec.spec_from_options(lengths=[L], **kwargs)


def test_extension_methods_run_dca_and_rerope_as_their_reference_code_and_as_the_papers():
  from experiments import extension

  # ChunkLlama's code since 2024-04-25 (local_window L/8, its factor against L) and as released
  # with the paper (L/16, no factor); ReRoPE's patch (log-n against L) and the clamp alone.
  options = extension.methods(128, 2048)
  assert options["dca"] == dict(extend="dca", extend_fields=dict(chunk=80, local=16, train_len=128))
  assert options["dca_paper"]["extend_fields"] == dict(chunk=88, local=8)
  assert extension.methods(4096, 65536)["dca"]["extend_fields"]["chunk"] == 2560
  assert options["rerope"]["extend_fields"] == dict(window=16, train_len=128)
  assert options["rerope_clamp"] == dict(extend="rerope_clamp", extend_fields=dict(window=16))
  # Self-Extend at L = 128 to 2048: W = 32; G = 22 keeps 2047 // 22 + 32 - 32/22 = 123.5 < 127.
  assert options["self_extend"]["extend_fields"] == dict(window=32, group=22)


def test_the_presets_and_the_extrapolation_grid_take_their_arms_from_configs_arms():
  import importlib

  from configs import arms, default
  from experiments import extrapolation

  # The presets: one NoPE layer in 4 (Llama 4, the RNoPE-SWA paper), windows of L/4.
  for name in ("irope", "rnope_swa", "fox"):
    preset = importlib.import_module(f"configs.{name}").get_config()
    assert preset == arms.apply(default.get_config(), name), name
  irope = arms.overrides("irope", seq_len=512)
  assert irope["posenc.layer_pattern"] == "rope,rope,rope,nope"
  assert irope["model.attention_window_pattern"] == "128,128,128,0"
  assert irope["posenc.query_scale_floor"] == 128.0
  # The grid: the same arms with its 3 layers, each run's overrides the arm's on top of its budget.
  scale = extrapolation.SCALES["cpu"]
  runs = {run.name: run for run in extrapolation.grid_runs(scale, set())}
  for name in (*arms.FRONTIER, *arms.RECALIBRATIONS):
    fields = arms.overrides(name, seq_len=scale.seq_len, nope_every=3)
    run = runs[name]
    assert {k: run.overrides[k] for k in fields} == fields, name
    assert run.encoding == fields["posenc.kind"] and run.init_from == arms.ARMS[name].starts_from
  assert runs["rnope_swa"].overrides["posenc.layer_pattern"] == "rope,rope,nope"
  assert all(arm.description and "\n" not in arm.description for arm in arms.ARMS.values())
  with pytest.raises(KeyError, match="unknown arm 'irop'"):
    arms.overrides("irop", seq_len=128)
  with pytest.raises(ValueError, match="nope_every=1"):
    arms.overrides("irope", seq_len=128, nope_every=1)
