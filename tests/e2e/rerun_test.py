"""experiments/rerun.py: a committed run's config rebuilt from its JSON, retrained, compared."""

import json
import pathlib
import sys

import pytest

from experiments import grid, rerun, synthetic
from roformer.testing import REPO

SYNTHETIC = sorted((REPO / "results" / "synthetic").glob("*.json"))


def test_synthetic_overrides_rebuild_the_config_they_record():
  config = synthetic.run_config(synthetic.SCALES["cpu"], "copy", "irope", False)
  overrides = synthetic.run_overrides(config)
  assert overrides["posenc.layer_pattern"] == "rope,nope" and "model.num_layers" in overrides
  assert "train.seed" not in overrides  # at its default
  rebuilt = grid.make_config("", json.loads(json.dumps(overrides)))  # as a JSON gives them back
  assert grid.run_settings(rebuilt, None) == grid.run_settings(config, None)


@pytest.mark.parametrize("path", SYNTHETIC, ids=[p.stem for p in SYNTHETIC])
def test_every_committed_synthetic_run_is_rebuilt_from_its_arm(path, tmp_path):
  # What rerun.py does for a JSON without overrides: the arm's config from configs/arms.py and
  # the grid's settings must be the config the JSON's settings describe, field by field.
  record = json.loads(path.read_text())
  task, encoding, randomized = record["task"], record["encoding"], record["randomized"]
  scale = synthetic.SCALES["cpu"]
  settings = synthetic.run_settings(scale, task, encoding, randomized, tmp_path)
  assert grid.finished_record(path, settings) is not None


def test_tokenizer_line_tells_a_different_tokenizer_from_an_unrecorded_one():
  assert "DIFFERS" in rerun.tokenizer_line("a" * 64, "b" * 64)
  assert "the recorded one" in rerun.tokenizer_line("a" * 64, "a" * 64)
  assert "keeps no tokenizer hash" in rerun.tokenizer_line(None, "a" * 64)


@pytest.mark.slow
def test_rerun_of_a_synthetic_run_reproduces_its_scores(tmp_path, monkeypatch, capsys):
  # A two-step run recorded as the grid records one, then retrained by rerun.py.
  scale = synthetic.SCALES["tiny"]
  config = synthetic.run_config(scale, "copy", "rope", False)
  config.train.num_train_steps = 2
  config.train.log_every_steps = 1
  spec = {**synthetic.eval_spec(scale, "copy", False), "examples": 4}
  spec["lengths"] = spec["lengths"][:2]
  workdir = tmp_path / "grid_run"
  grid.train_to_end("copy/rope", config, workdir)
  result = {"run": "copy/rope", "encoding": "rope", "randomized": False}
  result.update(synthetic.score(str(workdir), spec), base="")
  result.update(overrides=synthetic.run_overrides(config))
  settings = grid.run_settings(config, spec, workroot=tmp_path)
  result.update(settings=settings, settings_hash=grid.settings_hash(settings))
  path = tmp_path / "copy__rope.json"
  path.write_text(json.dumps(result))
  monkeypatch.setattr(sys, "argv", ["rerun", str(path), f"--workdir={tmp_path / 'rerun'}"])
  with pytest.raises(SystemExit) as exit_:
    rerun.main()
  out = capsys.readouterr().out
  assert exit_.value.code == 0, out
  assert "config from its recorded overrides: matches the recorded settings" in out
  assert out.count("exact_match recorded") == 2 and "largest difference 0.00e+00" in out
  # A JSON whose overrides no longer give its settings is refused, naming the field.
  result["overrides"]["optim.learning_rate"] = 1.0
  path.write_text(json.dumps(result))
  with pytest.raises(SystemExit, match="optim.learning_rate"):
    rerun.main()
  assert pathlib.Path(tmp_path / "rerun" / "run" / "config.json").exists()
