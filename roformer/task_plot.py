"""Plots of task evaluations: accuracy against task length, passkey depth x length heatmaps.

No JAX here, so `eval.py --compare` draws task results without loading a model.
"""

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: eval runs on servers and TPU VMs

import matplotlib.pyplot as plt  # noqa: E402
from etils import epath  # noqa: E402

from roformer import eval_plot  # noqa: E402

# NAME of DIR/eval/NAME.json and .png written by `eval.py --task_lengths`.
DEFAULT_NAME = "task_vs_length"


def run_label(name: str, result: dict) -> str:
  """Legend label: the run's name, its encoding and randomized positions if trained with them."""
  details = [] if result.get("posenc") == name else [str(result.get("posenc", "?"))]
  if result.get("randomize_max"):
    details.append(f"randomized to {result['randomize_max']}")
  return f"{name} ({', '.join(details)})" if details else name


def _save(fig, path) -> epath.Path:
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=120)
  plt.close(fig)
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(buffer.getvalue())
  return path


def plot_task_runs(runs: Sequence[tuple[str, dict]], path, *, title: str = "") -> epath.Path:
  """Exact match (solid) and per-token accuracy (dashed) against task length for several runs.

  The training range of the first run is shaded.

  Args:
    runs: (label, task JSON dict) per run.
    path: output PNG path (local or gs://).
    title: figure title.
  """
  fig, ax = plt.subplots(figsize=(7.5, 4.6), constrained_layout=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (label, result) in enumerate(runs):
    points = [r for r in result["records"] if "skipped" not in r]
    if not points:
      continue
    xs = [r["length"] for r in points]
    color = colors[i % len(colors)]
    ax.plot(xs, [r["exact_match"] for r in points], "-o", color=color, label=label)
    ax.plot(xs, [r["token_accuracy"] for r in points], "--", color=color, alpha=0.6)
  if runs:
    lo, hi = runs[0][1].get("train_lengths", (0, 0))
    if hi:
      ax.axvspan(lo, hi, color="0.9", zorder=0, label="training lengths")
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("task length")
  ax.set_ylabel("accuracy (solid: exact match, dashed: per token)")
  ax.grid(True, alpha=0.3)
  if ax.lines:
    ax.legend(fontsize=8)
  task = runs[0][1].get("task", "") if runs else ""
  ax.set_title(title or f"{task}: accuracy vs length")
  return _save(fig, path)


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
  return _save(fig, path)


def compare_runs(sources: Sequence[str], plot, *, name: str = DEFAULT_NAME) -> epath.Path:
  """Draws several runs' task JSON (DIR/eval/NAME.json, or JSON paths) in one plot."""
  results = eval_plot.read_results(sources, name, hint=" --task_lengths=...")
  runs = [(run_label(workdir.name, result), result) for workdir, result in results]
  return plot_task_runs(runs, plot)
