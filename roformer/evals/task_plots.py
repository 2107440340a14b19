"""Plots of task evaluations: accuracy against task length, passkey depth x length heatmaps.

No JAX here, so `eval.py --compare` draws task results without loading a model.
"""

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: eval runs on servers and TPU VMs

import matplotlib.pyplot as plt  # noqa: E402
from etils import epath  # noqa: E402

from roformer.evals import plots  # noqa: E402
from roformer.evals.effective_length import rule_label  # noqa: E402

# NAME of DIR/eval/NAME.json and .png written by `eval.py --task_lengths`.
DEFAULT_NAME = "task_vs_length"


def run_label(name: str, result: dict) -> str:
  """Legend label: the run's name, its encoding and randomized positions if trained with them."""
  details = [] if result.get("posenc") == name else [str(result.get("posenc", "?"))]
  if result.get("randomize_max"):
    details.append(f"randomized to {result['randomize_max']}")
  return f"{name} ({', '.join(details)})" if details else name


def _colors(count: int) -> list:
  """Matplotlib's 10-colour cycle, two more for a grid of 12, 20 colours past that."""
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  if count <= len(cycle) + 2:
    return [*cycle, "black", "gold"]
  return list(plt.get_cmap("tab20").colors)


def _shade_training_range(ax, runs: Sequence[tuple[str, dict]]) -> None:
  lo, hi = runs[0][1].get("train_lengths", (0, 0)) if runs else (0, 0)
  if hi:
    ax.axvspan(lo, hi, color="0.9", zorder=0, label="training lengths")


def _length_axis(ax) -> None:
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("task length (log scale)")
  ax.grid(True, alpha=0.3)


def plot_task_runs(runs: Sequence[tuple[str, dict]], path, *, title: str = "") -> epath.Path:
  """Exact match (solid) and per-token accuracy (dashed) against task length for several runs.

  The training range of the first run is shaded; a run's effective length by exact match (its
  JSON's "effective_length") is a star on the x axis under it and a note in its label.

  Args:
    runs: (label, task JSON dict) per run.
    path: output PNG path (local or gs://).
    title: figure title.
  """
  fig, ax = plt.subplots(figsize=(7.5, 4.6), constrained_layout=True)
  colors = _colors(len(runs))
  rules = {}  # legend entries of the effective-length rules drawn, each once
  for i, (label, result) in enumerate(runs):
    points = [r for r in result["records"] if "skipped" not in r]
    if not points:
      continue
    xs = [r["length"] for r in points]
    color = colors[i % len(colors)]
    effective = result.get("effective_length")
    found = effective["exact_match"] if effective else None
    if found is not None:
      label = f"{label}, effective n={found['length'] or 'none'}"
      rules.setdefault(rule_label(effective["rule"], perplexity=False))
    ax.plot(xs, [r["exact_match"] for r in points], "-o", color=color, label=label)
    ax.plot(xs, [r["token_accuracy"] for r in points], "--", color=color, alpha=0.6)
    if found is not None and found["length"] is not None:
      plots.mark_effective_length(ax, found["length"], color, "-")
  for rule in rules:
    ax.plot([], [], "*", color="0.4", markersize=10, linestyle="none", label=rule)
  _shade_training_range(ax, runs)
  _length_axis(ax)
  ax.set_ylabel("accuracy (solid: exact match, dashed: per token)")
  plots.place_legend(fig, ax)
  task = runs[0][1].get("task", "") if runs else ""
  ax.set_title(title or f"{task}: accuracy vs length")
  return plots.save_figure(fig, path)


METRIC_LABELS = {"exact_match": "exact match", "token_accuracy": "per-token accuracy"}


def plot_task_grid(
  panels: Sequence[tuple[str, Sequence[tuple[str, dict]]]],
  path,
  *,
  title: str = "",
  baseline: dict | None = None,
) -> epath.Path:
  """Exact match and per-token accuracy against task length, one column per group of runs (a
  grid's many encodings), one row per metric.

  Args:
    panels: (panel title, [(label, task JSON dict), ...]) per panel.
    path: output PNG path (local or gs://).
    title: figure title.
    baseline: {"label", "lengths", "exact_match", "token_accuracy"}: a reference drawn in every
      panel (e.g. associative recall's predictor that never looks a key up).
  """
  return plots.save_figure(task_grid_figure(panels, title=title, baseline=baseline), path)


def task_grid_figure(
  panels: Sequence[tuple[str, Sequence[tuple[str, dict]]]],
  *,
  title: str = "",
  baseline: dict | None = None,
  metrics: Sequence[str] = ("exact_match", "token_accuracy"),
) -> plt.Figure:
  """The figure of `plot_task_grid`. A label keeps its colour in every panel, so an encoding can
  be followed from one panel (consecutive positions) to the next (randomized positions); one
  legend below the panels names each label once. A score averaged over draws of positions shows
  the draws' range as a vertical bar."""
  labels = list(dict.fromkeys(label for _, runs in panels for label, _ in runs))
  colors = _colors(len(labels))
  color_of = {label: colors[i % len(colors)] for i, label in enumerate(labels)}
  fig, axes = plt.subplots(
    len(metrics), len(panels), figsize=(5.2 * len(panels), 3.9 * len(metrics)), sharey=True,
    squeeze=False,
  )  # fmt: skip
  for row, metric in enumerate(metrics):
    for ax, (panel_title, runs) in zip(axes[row], panels, strict=True):
      for label, result in runs:
        points = [r for r in result["records"] if "skipped" not in r]
        if not points:
          continue
        xs = [r["length"] for r in points]
        ys = [r[metric] for r in points]
        ax.plot(xs, ys, "-o", markersize=4, color=color_of[label], label=label)
        spread = [(x, r[f"{metric}_draws"]) for x, r in zip(xs, points, strict=True)
                  if r.get(f"{metric}_draws")]  # fmt: skip
        if spread:
          ax.vlines([x for x, _ in spread], [min(d) for _, d in spread],
                    [max(d) for _, d in spread], color=color_of[label], linewidth=2.5,
                    alpha=0.5)  # fmt: skip
      if baseline is not None:
        ax.plot(baseline["lengths"], baseline[metric], ":", color="black", linewidth=1.5,
                label=baseline["label"])  # fmt: skip
      _shade_training_range(ax, runs)
      _length_axis(ax)
      ax.set_title(panel_title if row == 0 else "")
      if row < len(metrics) - 1:
        ax.set_xlabel("")
    axes[row][0].set_ylabel(METRIC_LABELS.get(metric, metric))
  by_name = {}  # every panel's labels, each once
  for ax in axes.flat:
    for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
      by_name.setdefault(name, handle)
  fig.legend(by_name.values(), by_name.keys(), loc="lower center", ncol=min(len(by_name), 7),
             fontsize=8, frameon=False)  # fmt: skip
  fig.suptitle(title)
  rows = -(-len(by_name) // 7)
  fig.tight_layout(rect=(0, (0.04 + 0.035 * rows) / len(metrics) * 1.6, 1, 1))
  return fig


def plot_passkey_heatmap(result: dict, path) -> epath.Path:
  """Passkey exact match by depth of the key (rows) and length (columns)."""
  grid = result["passkey_depths"]
  fig, ax = plt.subplots(figsize=(7, 3.8), constrained_layout=True)
  image = ax.imshow(grid["exact_match"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
  ax.set_xticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
  ax.set_yticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]])
  ax.set_xlabel("filler length (tokens)")
  ax.set_ylabel("depth of the key")
  for r, row in enumerate(grid["exact_match"]):
    for c, value in enumerate(row):
      ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=8)
  fig.colorbar(image, ax=ax, label="exact match")
  ax.set_title(f"passkey retrieval ({result.get('posenc', '?')})")
  return plots.save_figure(fig, path)


def compare_runs(sources: Sequence[str], plot, *, name: str = DEFAULT_NAME) -> epath.Path:
  """Draws several runs' task JSON (DIR/eval/NAME.json, or JSON paths) in one plot."""
  results = plots.read_results(sources, name, hint=" --task_lengths=...")
  runs = [(run_label(workdir.name, result), result) for workdir, result in results]
  return plot_task_runs(runs, plot)
