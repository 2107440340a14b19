"""Tests of roformer.evals.task_vs_length (scoring) and the synthetic pipeline end to end (slow)."""

import json
import os

import numpy as np
import pytest

from roformer import testing
from roformer.data import synthetic
from roformer.evals import task_plots, task_vs_length


def _predictor(examples, wrong=()):
  table = {np.asarray(t[:-1], np.int32).tobytes(): (i, t) for i, (t, _) in enumerate(examples)}

  def predict(inputs_BT, positions_BT):
    out = np.zeros_like(np.asarray(inputs_BT))
    for b, row in enumerate(np.asarray(inputs_BT)):
      i, tokens = table[row.tobytes()]
      out[b] = tokens[1:]
      for wi, t in wrong:
        if wi == i:
          out[b, t] = -1
    return out

  return predict


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_a_perfect_predictor_scores_one(task):
  examples = task_vs_length.eval_examples(task, max(5, synthetic.min_length(task)), 7, seed=0)
  got = task_vs_length.score_examples(_predictor(examples), examples, batch_size=3)
  assert got == {"exact_match": 1.0, "token_accuracy": 1.0, "examples": 7}


def test_one_wrong_answer_token_costs_one_example_and_one_token():
  examples = task_vs_length.eval_examples("copy", 4, 5, seed=0)  # answers: 4 tokens each, 20 in all
  # Target index t predicts token t + 1: answers are targets 4..7 (tokens 5..8); 0 is a prompt
  # target, whose errors do not count.
  predict = _predictor(examples, wrong=[(2, 5), (3, 0)])
  got = task_vs_length.score_examples(predict, examples, batch_size=2)
  assert got == {"exact_match": 4 / 5, "token_accuracy": 19 / 20, "examples": 5}


def test_fewer_examples_than_a_batch_run_as_one_batch_of_their_own_count():
  examples = task_vs_length.eval_examples("copy", 4, 5, seed=0)
  shapes, scored = [], _predictor(examples, wrong=[(2, 5)])

  def predict(inputs_BT, positions_BT):
    shapes.append(inputs_BT.shape)
    return scored(inputs_BT, positions_BT)

  got = task_vs_length.score_examples(predict, examples, batch_size=64)
  assert shapes == [(5, len(examples[0][0]) - 1)]  # not 64 rows, 59 of them repeats
  assert got == {"exact_match": 4 / 5, "token_accuracy": 19 / 20, "examples": 5}


def test_eval_examples_depend_only_on_seed_length_and_depth():
  a = task_vs_length.eval_examples("passkey", 20, 3, seed=1, depth=0.5)
  b = task_vs_length.eval_examples("passkey", 20, 3, seed=1, depth=0.5)
  c = task_vs_length.eval_examples("passkey", 20, 3, seed=1, depth=0.0)
  assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
  assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a, c, strict=True))


def test_default_lengths_run_from_the_training_range_to_8x():
  assert task_vs_length.default_task_lengths(8, 32) == [8, 32, 64, 128, 256]


def test_task_plots_are_written(tmp_path):
  result = {
    "task": "passkey", "posenc": "rope", "train_lengths": [8, 16],
    "records": [{"length": 8, "exact_match": 1.0, "token_accuracy": 1.0},
                {"length": 64, "skipped": "too long"}],
    "passkey_depths": {"depths": [0.0, 1.0], "lengths": [8], "exact_match": [[1.0], [0.5]]},
  }  # fmt: skip
  png = task_plots.plot_task_runs([("a", result)], tmp_path / "a.png")
  heat = task_plots.plot_passkey_heatmap(result, tmp_path / "h.png")
  assert png.read_bytes()[:4] == heat.read_bytes()[:4] == b"\x89PNG"


def test_a_randomized_run_is_scored_at_positions_drawn_like_its_training_positions():
  # The paper's code draws a fresh sorted subset of [0, N) of the sequence's own length in every
  # forward pass, evaluation included; consecutive positions would be gaps training never made.
  examples = task_vs_length.eval_examples("copy", 4, 64, seed=0)  # 9 tokens: 8 model inputs
  seen = []

  def predict(inputs_BT, positions_BT):
    seen.append(np.asarray(positions_BT))
    return np.zeros_like(inputs_BT)

  result = task_vs_length.score_examples(
    predict, examples, batch_size=64, randomize_max=512, draws=3
  )
  assert len(seen) == 3 and all(p.shape == (64, 8) for p in seen)
  for positions in seen:
    assert np.all(np.diff(positions, axis=1) > 0) and positions.min() >= 0
    assert positions.max() < 512
    # The example's own 8 positions span [0, 512): the largest of 8 of 512 averages 455.
    assert 420 < positions[:, -1].mean() < 490
  assert not np.array_equal(seen[0], seen[1])  # a fresh draw each time
  assert len(result["exact_match_draws"]) == len(result["token_accuracy_draws"]) == 3
  # Consecutive positions for a run trained with them.
  seen.clear()
  task_vs_length.score_examples(predict, examples, batch_size=64)
  np.testing.assert_array_equal(seen[0], np.tile(np.arange(8), (64, 1)))


def test_task_grid_keeps_each_label_one_colour_and_one_legend_entry(tmp_path):
  def result(exact, draws=None):
    records = [
      {"length": n, "exact_match": exact, "token_accuracy": (1 + exact) / 2} for n in (4, 16)
    ]
    if draws:
      for r in records:
        r["token_accuracy_draws"] = draws
    return {"task": "copy", "train_lengths": [4, 8], "records": records}

  panels = [
    ("plain", [("rope", result(1.0)), ("alibi", result(0.5))]),
    ("randomized", [("alibi", result(0.25)), ("rope", result(0.0, draws=[0.4, 0.6]))]),
  ]
  baseline = {"label": "no lookup", "lengths": [4, 16], "exact_match": [0.1, 0.0],
              "token_accuracy": [0.5, 0.2]}  # fmt: skip
  fig = task_plots.task_grid_figure(panels, title="copy", baseline=baseline)
  (left, right), (left_tok, right_tok) = np.asarray(fig.axes).reshape(2, 2)
  color = {ax: {line.get_label(): line.get_color() for line in ax.lines} for ax in (left, right)}
  assert color[left] == color[right]  # the same encoding, the same colour, in either order
  assert color[left]["rope"] != color[left]["alibi"]
  assert [line.get_ydata()[0] for line in right.lines] == [0.25, 0.0, 0.1]  # + the baseline
  # The second row is per-token accuracy, with the range of the draws as a bar.
  assert [line.get_ydata()[0] for line in right_tok.lines] == [0.625, 0.5, 0.5]
  (bars,) = right_tok.collections[:1]
  assert [list(seg[:, 1]) for seg in bars.get_segments()] == [[0.4, 0.6], [0.4, 0.6]]
  assert left_tok.get_ylabel() == "per-token accuracy" and left.get_ylabel() == "exact match"
  names = [text.get_text() for text in fig.legends[0].get_texts()]
  assert names == ["rope", "alibi", "no lookup", "training lengths"]
  png = task_plots.plot_task_grid(panels, tmp_path / "grid.png")
  assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_draws_task_curves_of_several_runs(tmp_path):
  for name in ("a", "b"):
    result = {
      "task": "copy", "posenc": name, "randomize_max": 0, "train_lengths": [2, 4],
      "records": [{"length": 2, "exact_match": 0.5, "token_accuracy": 0.75}],
    }  # fmt: skip
    (tmp_path / name / "eval").mkdir(parents=True)
    (tmp_path / name / "eval" / "task_vs_length.json").write_text(json.dumps(result))
  png = task_plots.compare_runs([str(tmp_path / "a"), str(tmp_path / "b")], tmp_path / "c.png")
  assert png.read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(FileNotFoundError, match="--task_lengths"):
    task_plots.compare_runs([str(tmp_path / "missing")], tmp_path / "d.png")


# ---- End to end (slow): train.py by config alone, evaluation at 8x the training length ----

TINY = {
  "model.num_layers": 1, "model.emb_dim": 16, "model.num_heads": 2, "model.mlp_dim": 32,
  "data.source": "synthetic", "data.task": "copy", "data.task_min_len": 2,
  "data.task_max_len": 4, "data.seq_len": 8, "train.global_batch_size": 4,
  "train.num_train_steps": 3, "train.eval_max_tokens": 64, "train.log_every_steps": 1,
  "optim.warmup_steps": 1,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
  "posenc",
  [
    {"posenc.kind": "kerple"},
    {"posenc.kind": "fire"},
    {"posenc.kind": "sandwich"},
    {"posenc.kind": "cope"},
    {"posenc.kind": "rope", "posenc.rope_truncate": 0.5},
    {"posenc.kind": "learned", "posenc.max_len": 64, "posenc.randomize_max": 64},
  ],
  ids=["kerple", "fire", "sandwich", "cope", "prope", "learned+randomized"],
)
def test_new_encodings_train_by_config_and_evaluate_at_8x(tmp_path, posenc):
  """In one process: train.py's and eval.py's flag handling is tested in tests/e2e."""
  from roformer.train import loop as train_loop

  workdir = str(tmp_path / "run")
  config = testing.config_file_with("configs/default.py", {**TINY, **posenc})
  train_loop.train_and_evaluate(config, workdir)
  lines = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [x["step"] for x in lines if "train_loss" in x] == [1, 2, 3]
  result, _ = task_vs_length.evaluate_tasks(
    workdir, lengths=[2, 4, 32], num_examples=4, log=lambda line: None
  )
  assert json.loads(open(os.path.join(workdir, "eval", "task_vs_length.json")).read()) == result
  assert [r["length"] for r in result["records"]] == [2, 4, 32]  # 32 = 8x the longest
  assert all(0.0 <= r["token_accuracy"] <= 1.0 for r in result["records"])
  randomized = "posenc.randomize_max" in posenc
  kind = "randomized" if randomized else "consecutive"
  assert result["positions"]["kind"] == kind
  assert all(("token_accuracy_draws" in r) == randomized for r in result["records"])
  assert os.path.exists(os.path.join(workdir, "eval", "task_vs_length.png"))


def test_task_evaluation_records_and_logs_its_effective_length(tmp_path, monkeypatch):
  from flax import nnx

  from configs import default
  from roformer import config as config_lib
  from roformer.evals.effective_length import EffectiveRule, task_effective_lengths
  from roformer.nn.model import make_model

  config = default.get_config()
  config.model.num_layers, config.model.emb_dim = 1, 16
  config.model.num_heads, config.model.mlp_dim = 2, 32
  config.data.source, config.data.task = "synthetic", "copy"
  config.data.task_min_len, config.data.task_max_len, config.data.seq_len = 2, 4, 8
  config_lib.write_config_json(tmp_path, config_lib.run_config_from_dict(config, vocab_size=261))
  restored = lambda workdir, run_config, model_cfg, step=None: (  # noqa: E731
    make_model(model_cfg, rngs=nnx.Rngs(0)),
    5,
  )
  monkeypatch.setattr(task_vs_length.runs, "restore_for_eval", restored)
  lines = []
  rule = EffectiveRule(threshold=0.25)
  result, path = task_vs_length.evaluate_tasks(
    tmp_path, lengths=[2, 4, 8], num_examples=4, effective=rule, log=lines.append
  )
  written = json.loads(path.read_text())
  expected = task_effective_lengths(
    {k: v for k, v in written.items() if k != "effective_length"}, rule
  )
  assert written["effective_length"] == json.loads(json.dumps(expected))
  assert written["effective_length"]["rule"]["threshold"] == 0.25
  assert written["effective_length"]["exact_match"]["reference_length"] == 4
  assert sum(line.startswith("effective length (") for line in lines) == 2
  with pytest.raises(ValueError, match="least task score"):
    task_vs_length.evaluate_tasks(tmp_path, lengths=[2], effective=EffectiveRule(threshold=2.0))


def test_task_evaluation_refuses_a_perplexity_run(tmp_path):
  from configs import default
  from roformer import config as config_lib

  config_lib.write_config_json(tmp_path, config_lib.run_config_from_dict(default.get_config()))
  with pytest.raises(ValueError, match="trained with data.source='pystdlib'"):
    task_vs_length.evaluate_tasks(tmp_path, lengths=[4])


def _tiny_passkey_run(tmp_path, monkeypatch, seen_configs):
  """A 1-layer RoPE passkey run (written config, random weights) whose restored and rebuilt
  models record the ModelConfig they were built from."""
  from flax import nnx

  from configs import default
  from roformer import config as config_lib
  from roformer.nn.model import make_model

  config = default.get_config()
  config.model.num_layers, config.model.emb_dim = 1, 16
  config.model.num_heads, config.model.mlp_dim = 2, 32
  config.posenc.kind = "rope"
  config.data.source, config.data.task = "synthetic", "passkey"
  config.data.task_min_len, config.data.task_max_len = 4, 8
  config.data.seq_len = synthetic.example_length("passkey", 8) - 1
  config_lib.write_config_json(tmp_path, config_lib.run_config_from_dict(config, vocab_size=261))

  def restored(workdir, run_config, model_cfg, step=None):
    seen_configs.append(model_cfg)
    return make_model(model_cfg, rngs=nnx.Rngs(0)), 5

  real_with_config = task_vs_length.runs.with_config

  def with_config(model, cfg):
    seen_configs.append(cfg)
    return real_with_config(model, cfg)

  monkeypatch.setattr(task_vs_length.runs, "restore_for_eval", restored)
  monkeypatch.setattr(task_vs_length.runs, "with_config", with_config)
  return config.data.seq_len


def test_task_evaluation_applies_a_scaling_per_length_and_an_extension(tmp_path, monkeypatch):
  from roformer.evals.spec import RopeOverride
  from roformer.posenc.config import ContextExtension

  seen = []
  seq_len = _tiny_passkey_run(tmp_path, monkeypatch, seen)
  lengths = [4, 8, 32]
  result, path = task_vs_length.evaluate_tasks(
    tmp_path, lengths=lengths, num_examples=2, rope=RopeOverride("yarn", "auto"),
    log=lambda _: None,
  )  # fmt: skip
  assert path.name == "task_vs_length_yarn_auto.json"
  assert result["rope_scaling"] == {"kind": "yarn", "factor": "auto"}
  # "auto": each length's example tokens over the training length, at least 1.
  factors = {c.posenc.scaling.factor for c in seen if c.posenc.scaling.kind == "yarn"}
  expected = {max(1.0, (synthetic.example_length("passkey", n) - 1) / seq_len) for n in lengths}
  assert factors == expected and len(expected) == 2
  assert all(c.posenc.scaling.original_max_len == seq_len for c in seen)

  # The depth grid of every length is scored by that length's model, as its record is.
  depth_middle = result["passkey_depths"]["exact_match"]
  assert len(depth_middle) == len(task_vs_length.PASSKEY_DEPTHS)
  assert (tmp_path / "eval" / "task_vs_length_yarn_auto_passkey_heatmap.png").exists()

  seen.clear()
  ext = ContextExtension("sinks", sinks=1, window=6)
  result, path = task_vs_length.evaluate_tasks(
    tmp_path, lengths=[4, 8], num_examples=2, extension=ext, window=0, log=lambda _: None
  )
  assert path.name == "task_vs_length_sinks_sinks1_window6.json"
  assert result["context_extension"]["kind"] == "sinks" and seen
  assert all(c.posenc.extension == ext for c in seen)
  assert "sinks (sinks 1, window 6)" in result["notes"]


_MAKE_PREDICT = task_vs_length.make_predict  # before any test patches it


def _scored_predictions(workdir, monkeypatch, lengths, **kwargs):
  """(result, JSON path, the greedy predictions of every batch scored) of an evaluation of 8
  examples per length."""
  out = []

  def make_predict(model):
    predict = _MAKE_PREDICT(model)
    return lambda *a: out.append(np.asarray(predict(*a))) or out[-1]

  monkeypatch.setattr(task_vs_length, "make_predict", make_predict)
  result, path = task_vs_length.evaluate_tasks(
    workdir, lengths=lengths, num_examples=8, log=lambda _: None, **kwargs
  )
  return result, path, out


def test_task_evaluation_with_an_extension_covering_every_key_scores_as_plain(
  tmp_path, monkeypatch
):
  from roformer.posenc.config import ContextExtension

  _tiny_passkey_run(tmp_path, monkeypatch, [])

  def predictions(**kwargs):
    """The greedy predictions of every scored batch (a random model scores 0 everywhere)."""
    _, _, out = _scored_predictions(tmp_path, monkeypatch, [4, 8, 16], **kwargs)
    return np.concatenate([p.ravel() for p in out])

  plain = predictions()
  # Every key within the recent window: the sinks' pieces are the plain causal attention.
  wide = predictions(extension=ContextExtension("sinks", sinks=1, window=4096))
  narrow = predictions(extension=ContextExtension("rerope", window=1))
  np.testing.assert_array_equal(wide, plain)
  # Negative control: every distance clamped to 1 changes the predictions.
  assert np.mean(narrow != plain) > 0.05


def test_task_evaluation_imposes_a_query_temperature_beyond_the_training_length(
  tmp_path, monkeypatch
):
  seen = []
  seq_len = _tiny_passkey_run(tmp_path, monkeypatch, seen)

  def predictions(**kwargs):
    """Greedy predictions per task length (the first batch of each)."""
    result, path, out = _scored_predictions(tmp_path, monkeypatch, [8, 64], **kwargs)
    by_length = {}
    for pred in out:  # the depth grid scores each length again: keep the first of each width
      by_length.setdefault(pred.shape[1], pred)
    return result, path, [by_length[w] for w in sorted(by_length)]

  _, _, plain = predictions()
  seen.clear()
  result, path, scaled = predictions(query_scale="logn")
  assert path.name == "task_vs_length_qscale_logn.json" and result["query_scale"] == "logn"
  assert seen and all(
    (c.posenc.query_scale, c.posenc.query_scale_len) == ("logn", seq_len) for c in seen
  )
  # Within the training length every query sees n <= L keys, where log_L(n) is 1 ...
  assert synthetic.example_length("passkey", 8) - 1 <= seq_len
  np.testing.assert_array_equal(scaled[0], plain[0])
  # ... and beyond it the queries grow (the negative control of the line above).
  assert np.mean(scaled[1] != plain[1]) > 0.01


def test_passkey_depths_are_scored_by_each_lengths_own_model(tmp_path, monkeypatch):
  from roformer.evals.spec import RopeOverride

  _tiny_passkey_run(tmp_path, monkeypatch, [])
  real_make_predict = task_vs_length.make_predict
  factors = []  # the "auto" factor of the model each scored batch ran through

  def make_predict(model):
    predict = real_make_predict(model)
    factor = model.cfg.posenc.scaling.factor

    def recorded(*args):
      factors.append((args[0].shape[1], factor))
      return predict(*args)

    return recorded

  monkeypatch.setattr(task_vs_length, "make_predict", make_predict)
  task_vs_length.evaluate_tasks(
    tmp_path, lengths=[4, 32], num_examples=2, rope=RopeOverride("linear", "auto"),
    log=lambda _: None,
  )  # fmt: skip
  # Every batch of one input length (its records and its depths alike) ran at one factor.
  by_length = {}
  for tokens, factor in factors:
    by_length.setdefault(tokens, set()).add(factor)
  assert len(by_length) == 2 and all(len(f) == 1 for f in by_length.values()), by_length
  assert {min(f) for f in by_length.values()} != {1.0}  # the longer one is scaled
