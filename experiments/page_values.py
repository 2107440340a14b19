"""The numbers a results page quotes in its prose, read from the committed run JSONs.

A page's notes.md writes `{{ppl pystdlib rope 2048}}` where it quotes a number; experiments/pages.py
calls the grid's value of that name with the words after it as arguments (all strings), and the
page shows what the JSONs give today. `{{synthetic.em passkey rope 128}}` quotes another grid.
Each grid's values are the public methods of its class below.
"""

from __future__ import annotations

import json
import pathlib
import statistics

from experiments import grid, report, synthetic


def _fmt2(value: float) -> str:
  return f"{value:.2f}"


class _Values:
  """One grid's run JSONs under `root` (results/<grid>), read once per scale."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self._records: dict[str, list[dict]] = {}

  def records(self, scale: str, sub: str = "") -> list[dict]:
    key = f"{scale}/{sub}"
    if key not in self._records:
      directory = self.root / scale / sub
      paths = sorted(directory.glob("*.json"))
      if not paths:
        raise ValueError(f"no run JSONs in {directory}")
      self._records[key] = [json.loads(p.read_text()) for p in paths]
    return self._records[key]

  def record(self, scale: str, run: str, sub: str = "") -> dict:
    for r in self.records(scale, sub):
      if r["run"] == run:
        return r
    raise ValueError(f"no run {run!r} in {self.root / scale / sub}")

  def count(self, scale: str, *budgets: str) -> str:
    """How many runs (of these budgets) the scale trained (not the evaluation-only ones)."""
    return str(sum(1 for r in self._chosen(scale, budgets) if r.get("train_seconds")))

  def minutes(self, scale: str, *budgets: str) -> str:
    """Training minutes of the runs (of these budgets), summed."""
    return f"{sum(r.get('train_seconds', 0) for r in self._chosen(scale, budgets)) / 60:.1f}"

  def minutes_range(self, scale: str, *budgets: str) -> str:
    """'fastest-slowest' training minutes of one run among the runs of these budgets."""
    chosen = self._chosen(scale, budgets)
    times = [r["train_seconds"] / 60 for r in chosen if r.get("train_seconds")]
    return f"{min(times):.1f}-{max(times):.1f}"

  def _chosen(self, scale: str, budgets) -> list[dict]:
    return [r for r in self.records(scale) if not budgets or r.get("budget") in budgets]


def _ratio(a: float, b: float, digits: int) -> str:
  return f"{a / b:.{digits}f}"


def _percent(a: float, b: float) -> str:
  """|a / b - 1| in whole percent (the prose says which way)."""
  return f"{abs(a / b - 1) * 100:.0f}"


class Extrapolation(_Values):
  """`run` is a run name, or run:scaling for another of its evaluations (rope:yarn, xpos:bca);
  lengths are tokens; perplexity on non-overlapping windows unless `protocol` says sliding."""

  def __init__(self, root: pathlib.Path):
    super().__init__(root)
    self._rows: dict[str, list[dict]] = {}

  def _ppl(self, scale: str, run: str, length: str, protocol: str = "nonoverlapping") -> float:
    name, _, scaling = run.partition(":")
    scaling = scaling or self.record(scale, name)["evaluations"][0]["scaling"]
    if scale not in self._rows:
      self._rows[scale] = grid.csv_rows(self.records(scale))
    rows = self._rows[scale]
    value = report._ppl(rows, run=name, scaling=scaling, length=length, protocol=protocol)
    if value is None:
      raise ValueError(f"{scale}: no perplexity of {run} at {length} ({protocol})")
    return value

  def ppl(self, scale: str, run: str, length: str, protocol: str = "nonoverlapping") -> str:
    return report._fmt(self._ppl(scale, run, length, protocol))

  def ratio(self, scale: str, run_a: str, length_a: str, run_b: str, length_b: str) -> str:
    return _ratio(self._ppl(scale, run_a, length_a), self._ppl(scale, run_b, length_b), 2)

  def ratio1(self, scale: str, run_a: str, length_a: str, run_b: str, length_b: str) -> str:
    return _ratio(self._ppl(scale, run_a, length_a), self._ppl(scale, run_b, length_b), 1)

  def percent(self, scale: str, run_a: str, length_a: str, run_b: str, length_b: str) -> str:
    return _percent(self._ppl(scale, run_a, length_a), self._ppl(scale, run_b, length_b))

  def effective(self, scale: str, run: str, protocol: str = "nonoverlapping") -> str:
    """The effective length of the run's first evaluation (eval.py's default limit, relative to
    the run's loss at L), as table.md gives it."""
    record = self.record(scale, run)
    seq_len = report.read_header(self.root / scale)[1]
    return report._effective(record["evaluations"][0]["result"], protocol, seq_len)


class Mlm(_Values):
  """Masked-token loss (nats) and accuracy of the final checkpoint on non-overlapping windows,
  and the validation loss at L during training (`curve`, at a step)."""

  def _scored(self, scale: str, run: str, length: str) -> dict:
    for r in self.record(scale, run)["evaluations"][0]["result"]["records"]:
      if str(r["length"]) == length and r["protocol"] == "nonoverlapping" and "loss" in r:
        return r
    raise ValueError(f"{scale}: {run} has no score at {length}")

  def loss(self, scale: str, run: str, length: str) -> str:
    return f"{self._scored(scale, run, length)['loss']:.3f}"

  def acc(self, scale: str, run: str, length: str) -> str:
    return f"{self._scored(scale, run, length)['accuracy']:.3f}"

  def gap(self, scale: str, run_a: str, run_b: str, length: str) -> str:
    """Loss of run_a minus loss of run_b (nats)."""
    a, b = self._scored(scale, run_a, length), self._scored(scale, run_b, length)
    return f"{a['loss'] - b['loss']:.2f}"

  def tokens(self, scale: str, run: str, length: str) -> str:
    """Masked tokens the final score at `length` averages over."""
    return f"{self._scored(scale, run, length)['tokens']:,}"

  def _curve(self, scale: str, run: str) -> dict[int, dict]:
    metrics = self.record(scale, run).get("metrics", [])
    return {m["step"]: m for m in metrics if "eval_loss" in m}

  def curve(self, scale: str, run: str, step: str) -> str:
    return f"{self._curve(scale, run)[int(step)]['eval_loss']:.3f}"

  def curve_tokens(self, scale: str, run: str) -> str:
    """Masked tokens each validation point of the training curve averages over."""
    last = self._curve(scale, run)
    return f"{int(last[max(last)]['eval_tokens']):,}"


class Extension(_Values):
  """`method` is a row of the page's tables (plain, yarn, self_extend, ...): perplexity on
  non-overlapping windows at a length; task scores (`em`, `tok`) at a task length n."""

  def _run(self, scale: str, method: str, task: str = "") -> dict:
    prefix = task or "rope"
    name = prefix if method == "plain" else f"{prefix}_{method}"
    return self.record(scale, name, "tasks" if task else "")

  def _ppl(self, scale: str, method: str, length: str) -> float:
    for r in self._run(scale, method)["evaluations"][0]["result"]["records"]:
      if str(r["length"]) == length and "ppl" in r:
        return r["ppl"]
    raise ValueError(f"{scale}: {method} has no perplexity at {length}")

  def ppl(self, scale: str, method: str, length: str) -> str:
    return report._fmt(self._ppl(scale, method, length))

  def percent(self, scale: str, method_a: str, length_a: str, method_b: str, length_b: str) -> str:
    return _percent(self._ppl(scale, method_a, length_a), self._ppl(scale, method_b, length_b))

  def effective(self, scale: str, method: str) -> str:
    seq_len = report.read_header(self.root / scale)[1]
    result = self._run(scale, method)["evaluations"][0]["result"]
    return report._effective(result, "nonoverlapping", seq_len)

  def _task(self, scale: str, task: str, method: str, n: str, metric: str) -> str:
    for r in self._run(scale, method, task)["evaluations"][0]["result"]["records"]:
      if str(r["length"]) == n and metric in r:
        return _fmt2(r[metric])
    raise ValueError(f"{scale}: {task} under {method} has no score at n={n}")

  def em(self, scale: str, task: str, method: str, n: str) -> str:
    return self._task(scale, task, method, n, "exact_match")

  def tok(self, scale: str, task: str, method: str, n: str) -> str:
    return self._task(scale, task, method, n, "token_accuracy")

  def multiple(self, scale: str, task: str, n: str) -> str:
    """The input tokens of the task at length n over those at its longest training length, as
    the plain run scored them: a task length 2x its training one is fewer than 2x the tokens,
    the prompt's fixed part not growing."""
    result = self._run(scale, "plain", task)["evaluations"][0]["result"]
    tokens = {str(r["length"]): r["tokens"] for r in result["records"] if "tokens" in r}
    return f"{tokens[n] / tokens[str(result['train_lengths'][1])]:.1f}"

  def effective_n(self, scale: str, task: str, method: str) -> str:
    result = self._run(scale, method, task)["evaluations"][0]["result"]
    found = result.get("effective_length", {}).get("exact_match", {})
    return f"{found['length']}" + ("+" if found.get("first_failing") is None else "")


class Synthetic:
  """`run` is an encoding, with +randomized for its randomized run; scores at task length n;
  `past` is the mean over the evaluated lengths past the longest training length."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self._records: dict[str, dict] = {}
    self._no_lookup: dict[str, dict] = {}

  def record(self, task: str, run: str) -> dict:
    encoding, _, randomized = run.partition("+")
    stem = synthetic.file_stem(synthetic.run_name(task, encoding, bool(randomized)))
    if stem not in self._records:
      path = self.root / f"{stem}.json"
      if not path.exists():
        raise ValueError(f"no run JSON {path}")
      self._records[stem] = json.loads(path.read_text())
    return self._records[stem]

  def _score(self, task: str, run: str, n: str, metric: str, key: str = "records") -> float:
    for r in self.record(task, run)[key]:
      if str(r["length"]) == n and metric in r:
        return r[metric]
    raise ValueError(f"{task}/{run} has no {metric} at n={n}")

  def em(self, task: str, run: str, n: str) -> str:
    return _fmt2(self._score(task, run, n, "exact_match"))

  def tok(self, task: str, run: str, n: str) -> str:
    return _fmt2(self._score(task, run, n, "token_accuracy"))

  def plain(self, metric: str, task: str, run: str, n: str) -> str:
    """An evaluation arm's checkpoint scored without its option (metric: em or tok)."""
    return _fmt2(self._score(task, run, n, _METRICS[metric], key="plain_records"))

  def past(self, metric: str, task: str, run: str) -> str:
    """Mean score (metric: em or tok) over the evaluated lengths past training."""
    record = self.record(task, run)
    longest = record["train_lengths"][1]
    scores = [r[_METRICS[metric]] for r in record["records"] if r["length"] > longest]
    return _fmt2(statistics.mean(scores))

  def depth(self, run: str, n: str, depth: str) -> str:
    """Passkey exact match with the key at `depth` (0 = the start of the filler, 1 = its end)."""
    found = self.record("passkey", run)["passkey_depths"]
    row = found["exact_match"][found["depths"].index(float(depth))]
    return _fmt2(row[found["lengths"].index(int(n))])

  def nolookup(self, metric: str, n: str) -> str:
    """Associative recall's predictor that never looks a key up, at n pairs."""
    if n not in self._no_lookup:
      self._no_lookup[n] = synthetic.no_lookup_baseline([int(n)])
    return _fmt2(self._no_lookup[n][_METRICS[metric]][0])

  def minutes_range(self, task: str) -> str:
    """'fastest-slowest' training minutes of the task's runs of the classic encodings."""
    times = [
      r["train_seconds"] / 60
      for p in self.root.glob(f"{task}__*.json")
      if (r := json.loads(p.read_text()))["encoding"] in synthetic.CLASSIC
    ]
    return f"{min(times):.1f}-{max(times):.1f}"


_METRICS = {"em": "exact_match", "tok": "token_accuracy"}
GRIDS = {"extrapolation": Extrapolation, "mlm": Mlm, "extension": Extension, "synthetic": Synthetic}


def namespace(grid_name: str, results: pathlib.Path) -> dict:
  """name -> value function for a page of `grid_name`: its grid's values by their own names,
  every grid's as <grid>.<name>."""
  names = {}
  for other, cls in GRIDS.items():
    values = cls(results / other)
    for attr in dir(cls):
      if not attr.startswith("_") and attr not in ("records", "record", "root"):
        names[f"{other}.{attr}"] = getattr(values, attr)
        if other == grid_name:
          names[attr] = getattr(values, attr)
  return names
