"""Tests of evals/plots.py: it imports no JAX, reads the training length from a run's config.json,
and draws a figure whose titles fit and whose marks hide no point."""

import json
import subprocess
import sys

from roformer.evals import plots


def test_plots_import_no_jax():
  # eval.py --compare draws existing results with these modules alone, without starting JAX.
  code = (
    "import sys\n"
    "from roformer.evals import plots, task_plots\n"
    "print(','.join(m for m in ('jax', 'flax') if m in sys.modules))"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == ""


def test_training_length_reads_config_json_and_is_zero_without_it(tmp_path):
  assert plots.training_length(tmp_path) == 0
  (tmp_path / "config.json").write_text(json.dumps({"data": {"seq_len": 128}}))
  assert plots.training_length(tmp_path) == 128


def _two_panel_figure(tmp_path, monkeypatch):
  """plot_runs' figure for one run with both protocols, per-position losses and effective
  lengths at the shortest length (where the star used to sit on both curves' first points)."""
  figures = []
  monkeypatch.setattr(plots.plt, "close", figures.append)
  records = [
    {"length": n, "protocol": p, "loss": 3.0, "ppl": ppl + (p == "sliding"), "tokens": 8}
    for p in ("nonoverlapping", "sliding")
    for n, ppl in ((128, 20.0), (256, 30.0), (512, 60.0))
  ]
  found = {"length": 128}
  result = {
    "posenc": "rope",
    "records": records,
    "notes": ["stride L/4"],
    "per_position": {"length": 512, "protocol": "nonoverlapping", "loss": [3.0, 2.5, 2.4]},
    "effective_length": {
      "rule": {"kind": "fraction", "fraction": 0.9},
      "nonoverlapping": found,
      "sliding": found,
    },
  }
  plots.plot_runs([("a_run_name", result, 128)], tmp_path / "p.png", title="a_run_name step 20")
  return figures[0]


def test_two_panel_figure_titles_fit_inside_the_figure(tmp_path, monkeypatch):
  fig = _two_panel_figure(tmp_path, monkeypatch)
  renderer = fig.canvas.get_renderer()
  titles = [fig._suptitle, *(ax.title for ax in fig.axes[:2])]
  assert all(t.get_text() for t in titles)
  for text in titles:
    box = text.get_window_extent(renderer)
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, (text.get_text(), box, fig.bbox)
    assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, (text.get_text(), box, fig.bbox)


def test_effective_length_stars_leave_the_curves_points_visible(tmp_path, monkeypatch):
  fig = _two_panel_figure(tmp_path, monkeypatch)
  ax = fig.axes[0]
  curves = [line for line in ax.lines if line.get_label().startswith("a_run_name")]
  stars = [line for line in ax.lines if line.get_marker() == "*" and len(line.get_xdata())]
  assert len(curves) == 2 and len(stars) == 2
  points = [ax.transData.transform(xy) for c in curves for xy in c.get_xydata()]
  for star in stars:
    (x, y), radius = star.get_xydata()[0], star.get_markersize() / 72 * fig.dpi / 2
    assert x == 128
    centre = star.get_transform().transform((x, y))
    # No curve point lies under the star: it sits on the x axis, below the lowest point.
    assert min(((p - centre) ** 2).sum() ** 0.5 for p in points) > radius
  # The lines that mark the effective length are drawn behind the curves.
  markers = [
    line
    for line in ax.lines
    if line not in curves
    and list(line.get_xdata()) == [128, 128]
    and line.get_label() != "training length"
  ]
  assert len(markers) == 2
  assert max(m.get_zorder() for m in markers) < min(c.get_zorder() for c in curves)
