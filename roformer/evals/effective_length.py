"""Effective length (RULER, Hsieh et al. 2024): the longest evaluated length at which a run still
scores at or above a limit, read upward from its training length and stopping at the first
length below the limit.

RULER's limit is one absolute score for every model (Llama-2-7B's at 4K, 85.6%) and its effective
length is the last length before the first one under it: a model that falls under at 32K and
recovers at 64K has an effective length of 16K. This module reads the curve the same way (a dip
ends the effective length; a recovery after it does not count) with either limit:

  fraction   (default EffectiveRule.fraction = 0.9) the limit is that fraction of the run's own
             score at its training length. 0.9 because a 10% drop is well outside the noise of
             the default evaluation (128 examples per length: a score near 0.9 has a standard
             error of about 0.027, so 0.09 is more than 3 of them, where 0.95 would flag drops of
             2 standard errors, about one length in twenty by chance), and because RULER's own
             limit, 85.6, sits at about 0.9 of the best models' scores at 4K.
  threshold  an absolute limit: the least score of a task evaluation (RULER: 0.856), the largest
             perplexity of a perplexity evaluation.

Scores: a task's exact match or per-token accuracy (higher is better); for perplexity the score
is exp(-loss), the geometric mean probability of a target, so the fraction rule keeps every
length whose loss stays within -ln(fraction) nats of the loss at the training length (0.105 nats
for 0.9, a perplexity at most 1/0.9 = 1.11 times the training length's).

The training length is the longest scored length at or below it: data.task_max_len for a task,
data.seq_len for perplexity. Lengths below it are not read; a length that was skipped (the model
cannot take it) ends the effective length like a failing one. Imports no JAX (plots use it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

DEFAULT_FRACTION = 0.9
# RULER's absolute limit (Hsieh et al. 2024): Llama-2-7B's average score at 4K, 85.6%.
RULER_THRESHOLD = 0.856
TASK_METRICS = ("exact_match", "token_accuracy")
_ROUNDING = 1e-12
READING = "the last length before the first one under the limit, from the training length up"


@dataclasses.dataclass(frozen=True)
class EffectiveRule:
  """The limit an effective length is read against (eval.py --effective_fraction and
  --effective_threshold).

  Attributes:
    fraction: the limit is this fraction of the score at the training length, in (0, 1].
    threshold: > 0 replaces the fraction with an absolute limit: the least task score (in (0, 1])
      or the largest perplexity (> 1); 0 = use the fraction.
  """

  fraction: float = DEFAULT_FRACTION
  threshold: float = 0.0

  def __post_init__(self):
    if not 0.0 < self.fraction <= 1.0:
      raise ValueError(f"--effective_fraction must be in (0, 1], got {self.fraction}")
    if self.threshold < 0.0:
      raise ValueError(
        f"--effective_threshold must be > 0 (0 = use the fraction), got {self.threshold}"
      )

  def check_task_threshold(self) -> None:
    if self.threshold and not self.threshold <= 1.0:
      raise ValueError(
        f"--effective_threshold={self.threshold} is the least task score here (exact match or "
        "per-token accuracy), so it must be in (0, 1]"
      )

  def check_perplexity_threshold(self) -> None:
    if self.threshold and not self.threshold > 1.0:
      raise ValueError(
        f"--effective_threshold={self.threshold} is the largest perplexity here, so it must be > 1"
      )

  def as_json(self) -> dict:
    if self.threshold:
      return {"kind": "threshold", "threshold": self.threshold, "reading": READING}
    return {"kind": "fraction", "fraction": self.fraction, "reading": READING}


def effective_length(
  points: Sequence[tuple[int, float | None]],
  *,
  reference_length: int,
  fraction: float | None = None,
  minimum: float | None = None,
) -> dict:
  """The effective length of one curve of scores (higher is better).

  Args:
    points: (length, score or None where the length was skipped), any order.
    reference_length: the training length; the reference is the longest scored length <= it.
    fraction: the limit is fraction x the reference's score (exactly one of fraction, minimum).
    minimum: an absolute limit.

  Returns:
    {"length": the effective length or None, "reference_length", "reference_score", "limit",
    "first_failing": the first length from the reference up below the limit or skipped (None
    when none is)} and "reason" when length is None.
  """
  if (fraction is None) == (minimum is None):
    raise ValueError("give exactly one of fraction and minimum")
  points = sorted(points)
  scored_below = [(n, s) for n, s in points if n <= reference_length and s is not None]
  if not scored_below:
    return {
      "length": None, "reference_length": None, "reference_score": None, "limit": None,
      "first_failing": None,
      "reason": f"no length at or below the training length {reference_length} was scored",
    }  # fmt: skip
  ref_length, ref_score = scored_below[-1]
  limit = minimum if minimum is not None else fraction * ref_score
  result = {
    "length": None, "reference_length": ref_length, "reference_score": ref_score,
    "limit": limit, "first_failing": None,
  }  # fmt: skip
  if minimum is None and ref_score <= 0.0:
    return {**result, "reason": f"the score at the training length {ref_length} is 0"}
  for length, score in points:
    if length < ref_length:
      continue
    # "At or above" up to float rounding (0.9 x 0.8 is 0.7200000000000001); NaN fails.
    if score is None or not score >= limit - _ROUNDING:
      result["first_failing"] = length
      break
    result["length"] = length
  if result["length"] is None:
    result["reason"] = f"the score at the training length {ref_length} is under the limit"
  return result


def task_effective_lengths(result: dict, rule: EffectiveRule) -> dict:
  """The "effective_length" of a task_vs_length JSON dict: one per metric, each with the input
  tokens at its length (`tokens`, None with no length)."""
  rule.check_task_threshold()
  reference = result["train_lengths"][1]
  tokens = {r["length"]: r["tokens"] for r in result["records"] if "tokens" in r}
  out = {"rule": rule.as_json()}
  for metric in TASK_METRICS:
    points = [(r["length"], r.get(metric)) for r in result["records"]]
    limits = {"minimum": rule.threshold} if rule.threshold else {"fraction": rule.fraction}
    found = effective_length(points, reference_length=reference, **limits)
    out[metric] = {**found, "tokens": tokens.get(found["length"])}
  return out


def perplexity_effective_lengths(records: Sequence[dict], rule: EffectiveRule, *,
                                 train_length: int) -> dict:  # fmt: skip
  """The "effective_length" of a ppl_vs_length JSON's records: one per protocol, on the score
  exp(-loss), reported as losses: the reference's loss and the largest loss allowed
  (`max_loss`, with `max_ppl`)."""
  rule.check_perplexity_threshold()
  out = {"rule": rule.as_json()}
  for protocol in dict.fromkeys(r["protocol"] for r in records):
    points = [
      (r["length"], None if "skipped" in r else math.exp(-r["loss"]))
      for r in records
      if r["protocol"] == protocol
    ]
    limits = {"minimum": 1.0 / rule.threshold} if rule.threshold else {"fraction": rule.fraction}
    found = effective_length(points, reference_length=train_length, **limits)
    score, limit = found.pop("reference_score"), found.pop("limit")
    out[protocol] = {
      **found,
      "reference_loss": None if score is None else _loss(score),
      "max_loss": None if limit is None else _loss(limit),
      "max_ppl": None if limit is None else 1.0 / limit,
    }
  return out


def _loss(score: float) -> float:
  return -math.log(score) if score > 0.0 else math.inf


def describe(found: dict) -> str:
  """For logs: "64 (128 is the first length under the limit)", or "none (why)"."""
  if found["length"] is None:
    return f"none ({found.get('reason', 'no length')})"
  after = found["first_failing"]
  if after is None:
    return f"{found['length']} (no evaluated length is under the limit: it may be longer)"
  return f"{found['length']} ({after} is the first length under the limit)"


def rule_label(rule: dict, *, perplexity: bool) -> str:
  """A legend entry for a JSON "rule": what the marked effective length keeps."""
  if rule["kind"] == "threshold":
    limit = rule["threshold"]
    return (
      f"effective length (ppl <= {limit:g})" if perplexity else f"effective length (>= {limit:g})"
    )
  fraction = rule["fraction"]
  if perplexity:
    return f"effective length (loss <= training length's + {-math.log(fraction):.3g} nats)"
  return f"effective length (>= {fraction:g} x training length's)"
