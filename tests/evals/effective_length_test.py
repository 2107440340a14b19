"""Tests of evals.effective_length against hand-made result dicts: RULER's reading (the last
length before the first one under the limit), the fraction and absolute limits, skipped lengths,
perplexity's loss margin, and the plots that show it."""

import math

import pytest

from roformer.evals import plots, task_plots
from roformer.evals.effective_length import (
  EffectiveRule,
  effective_length,
  perplexity_effective_lengths,
  task_effective_lengths,
)


def test_a_falling_curve_ends_at_the_last_length_at_or_above_the_fraction():
  # 0.9 x 0.96 = 0.864: 64 (0.875) keeps it, 128 (0.5) does not; 8 (below training) is unread.
  points = [(8, 0.1), (32, 0.96), (64, 0.875), (128, 0.5), (256, 0.0)]
  found = effective_length(points, reference_length=32, fraction=0.9)
  assert found == {
    "length": 64, "reference_length": 32, "reference_score": 0.96,
    "limit": pytest.approx(0.864), "first_failing": 128,
  }  # fmt: skip


def test_a_curve_that_dips_and_recovers_ends_at_the_first_drop():
  # RULER's reading: 64 is under the limit 0.72, so the effective length is 32 although 128
  # (0.79) and 256 (0.75) are back above it.
  points = [(32, 0.8), (64, 0.7), (128, 0.79), (256, 0.75)]
  found = effective_length(points, reference_length=32, fraction=0.9)
  assert (found["length"], found["first_failing"]) == (32, 64)
  # Without the dip every length counts.
  points[1] = (64, 0.72)
  found = effective_length(points, reference_length=32, fraction=0.9)
  assert (found["length"], found["first_failing"]) == (256, None)


def test_a_score_exactly_at_the_limit_keeps_the_length():
  points = [(16, 0.5), (32, 0.25), (64, 0.24)]
  found = effective_length(points, reference_length=16, fraction=0.5)
  assert (found["length"], found["limit"], found["first_failing"]) == (32, 0.25, 64)


def test_an_absolute_threshold_is_rulers_fixed_limit():
  points = [(32, 0.9), (64, 0.86), (128, 0.85)]
  found = effective_length(points, reference_length=32, minimum=0.856)
  assert (found["length"], found["limit"], found["first_failing"]) == (64, 0.856, 128)
  # Under the limit at the training length already: no effective length at all.
  low = effective_length([(32, 0.8), (64, 0.9)], reference_length=32, minimum=0.856)
  assert low["length"] is None and low["first_failing"] == 32
  assert "under the limit" in low["reason"]


def test_a_skipped_length_ends_the_effective_length_like_a_failing_one():
  found = effective_length([(32, 1.0), (64, None), (128, 1.0)], reference_length=32, fraction=0.9)
  assert (found["length"], found["first_failing"]) == (32, 64)


def test_the_reference_is_the_longest_scored_length_at_or_below_the_training_length():
  points = [(8, None), (16, 0.5), (64, 0.46), (128, 0.44)]  # 8: below the reference, unread
  found = effective_length(points, reference_length=32, fraction=0.9)
  assert (found["reference_length"], found["length"], found["first_failing"]) == (16, 64, 128)
  nothing = effective_length([(64, 1.0)], reference_length=32, fraction=0.9)
  assert nothing["length"] is None and "no length at or below" in nothing["reason"]
  zero = effective_length([(32, 0.0), (64, 0.0)], reference_length=32, fraction=0.9)
  assert zero["length"] is None and "is 0" in zero["reason"]


def test_exactly_one_limit_is_given():
  with pytest.raises(ValueError, match="exactly one"):
    effective_length([(1, 1.0)], reference_length=1)
  with pytest.raises(ValueError, match="exactly one"):
    effective_length([(1, 1.0)], reference_length=1, fraction=0.9, minimum=0.5)


def _task_result():
  records = [
    {"length": 8, "tokens": 17, "exact_match": 1.0, "token_accuracy": 1.0},
    {"length": 32, "tokens": 65, "exact_match": 0.95, "token_accuracy": 0.99},
    {"length": 64, "tokens": 129, "exact_match": 0.5, "token_accuracy": 0.9},
    {"length": 128, "tokens": 257, "exact_match": 0.9, "token_accuracy": 0.5},
    {"length": 256, "skipped": "too long"},
  ]
  return {"task": "copy", "posenc": "rope", "train_lengths": [8, 32], "records": records}


def test_task_effective_lengths_per_metric_with_their_tokens():
  got = task_effective_lengths(_task_result(), EffectiveRule())
  assert got["rule"]["kind"] == "fraction" and got["rule"]["fraction"] == 0.9
  # Exact match: 0.5 at 64 is under 0.855 (the recovery at 128 does not count).
  assert got["exact_match"]["length"] == 32 and got["exact_match"]["tokens"] == 65
  assert got["exact_match"]["first_failing"] == 64
  # Per token: 0.9 >= 0.891 at 64, then 0.5 at 128.
  assert got["token_accuracy"]["length"] == 64 and got["token_accuracy"]["tokens"] == 129
  absolute = task_effective_lengths(_task_result(), EffectiveRule(threshold=0.4))
  assert absolute["rule"] == {
    "kind": "threshold",
    "threshold": 0.4,
    "reading": absolute["rule"]["reading"],
  }
  # 128 passes 0.4 in both metrics; 256 was skipped.
  assert absolute["exact_match"]["length"] == absolute["token_accuracy"]["length"] == 128
  assert absolute["exact_match"]["first_failing"] == 256


def _ppl_records(losses, protocol="nonoverlapping"):
  return [
    {"length": n, "protocol": protocol, "loss": loss, "ppl": math.exp(loss), "tokens": 64}
    for n, loss in losses
  ]


def test_perplexity_effective_length_is_a_loss_margin_of_minus_log_fraction():
  # Training length 64, loss 2.0 there: the margin is -ln 0.9 = 0.1054 nats, so 2.105 passes
  # and 2.106 does not; each protocol is read on its own.
  records = _ppl_records([(32, 2.3), (64, 2.0), (128, 2.105), (256, 2.106), (512, 2.0)])
  records += _ppl_records([(64, 2.0), (128, 2.05), (256, 2.1), (512, 2.2)], "sliding")
  got = perplexity_effective_lengths(records, EffectiveRule(), train_length=64)
  flat = got["nonoverlapping"]
  assert (flat["length"], flat["first_failing"], flat["reference_length"]) == (128, 256, 64)
  assert flat["reference_loss"] == pytest.approx(2.0)
  assert flat["max_loss"] == pytest.approx(2.0 - math.log(0.9))
  assert flat["max_ppl"] == pytest.approx(math.exp(2.0) / 0.9)
  assert (got["sliding"]["length"], got["sliding"]["first_failing"]) == (256, 512)


def test_perplexity_absolute_threshold_is_the_largest_perplexity():
  records = _ppl_records([(64, 2.0), (128, math.log(9.9)), (256, math.log(10.1))])
  records.append({"length": 512, "protocol": "nonoverlapping", "skipped": "too long"})
  got = perplexity_effective_lengths(records, EffectiveRule(threshold=10.0), train_length=64)
  assert got["nonoverlapping"]["length"] == 128
  assert got["nonoverlapping"]["max_ppl"] == pytest.approx(10.0)
  records = _ppl_records([(64, 2.0), (128, math.log(9.9)), (256, math.log(9.95))])
  records.append({"length": 512, "protocol": "nonoverlapping", "skipped": "too long"})
  got = perplexity_effective_lengths(records, EffectiveRule(threshold=10.0), train_length=64)
  assert (got["nonoverlapping"]["length"], got["nonoverlapping"]["first_failing"]) == (256, 512)


@pytest.mark.parametrize(
  ("rule", "check", "match"),
  [
    (dict(fraction=0.0), None, "--effective_fraction must be in"),
    (dict(fraction=1.5), None, "--effective_fraction must be in"),
    (dict(threshold=-1.0), None, "--effective_threshold must be > 0"),
    (dict(threshold=1.5), "check_task_threshold", "least task score"),
    (dict(threshold=0.9), "check_perplexity_threshold", "largest perplexity"),
  ],
)
def test_bad_rules_are_one_error_naming_the_flag(rule, check, match):
  with pytest.raises(ValueError, match=match):
    getattr(EffectiveRule(**rule), check or "as_json")()


def test_plots_mark_the_effective_length_and_say_the_rule(tmp_path, monkeypatch):
  drawn = []
  monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
  result = _task_result()
  result["effective_length"] = task_effective_lengths(result, EffectiveRule())
  task_plots.plot_task_runs([("run", result)], tmp_path / "t.png")
  ax = drawn[-1].axes[0]
  labels = [line.get_label() for line in ax.lines]
  assert "run, effective n=32" in labels
  assert "effective length (>= 0.9 x training length's)" in labels
  stars = [line for line in ax.lines if line.get_marker() == "*" and len(line.get_xdata())]
  # On the x axis (y in axes fractions) under the effective length, not on the curve's point.
  assert [(s.get_xdata()[0], s.get_ydata()[0]) for s in stars] == [(32, 0.0)]
  assert all(s.get_transform() == ax.get_xaxis_transform() for s in stars)
  ppl = {"posenc": "rope", "records": _ppl_records([(64, 2.0), (128, 2.5)]), "per_position": None}
  ppl["effective_length"] = perplexity_effective_lengths(
    ppl["records"], EffectiveRule(), train_length=64
  )
  plots.plot_runs([("run", ppl, 64)], tmp_path / "p.png")
  ax = drawn[-1].axes[0]
  labels = [line.get_label() for line in ax.lines]
  assert "run, effective L=64" in labels
  assert "effective length (loss <= training length's + 0.105 nats)" in labels
  stars = [line for line in ax.lines if line.get_marker() == "*" and len(line.get_xdata())]
  assert [(s.get_xdata()[0], s.get_ydata()[0]) for s in stars] == [(64, 0.0)]
  assert all(s.get_transform() == ax.get_xaxis_transform() for s in stars)
