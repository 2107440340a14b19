"""Plots of eval.py results: perplexity against context length, loss by position in the window.

Imports no JAX, so eval.py --compare draws existing results without starting it; DIR/config.json
is read through infra.workdir.read_config_json (roformer.config imports the model).
"""

import io
import json
import math
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: eval runs on servers and TPU VMs

import matplotlib.pyplot as plt  # noqa: E402
from etils import epath  # noqa: E402
from matplotlib import ticker  # noqa: E402

from roformer.evals.effective_length import rule_label  # noqa: E402
from roformer.infra import workdir as workdir_lib  # noqa: E402

# NAME of DIR/eval/NAME.json and .png when no scaling is applied and no --out is given.
DEFAULT_NAME = "ppl_vs_length"

PROTOCOL_STYLES = {
  "nonoverlapping": dict(linestyle="-", marker="o"),
  "sliding": dict(linestyle=":", marker="s"),
}


# Past this many lines a legend inside the axes hides the curves it names: it goes below them.
LEGEND_INSIDE_MAX = 8


def place_legend(fig, ax) -> None:
  """A legend in the axes for a few lines; below the axes, in two columns, for a grid's many."""
  lines = [line for line in ax.lines if not line.get_label().startswith("_")]
  if not lines:
    return
  if len(lines) <= LEGEND_INSIDE_MAX:
    ax.legend(fontsize=8)
    return
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
  rows = (len(lines) + 1) // 2
  width, height = fig.get_size_inches()
  fig.set_size_inches(width, max(height, 4.6 + 0.16 * rows))


def run_label(name: str, result: dict) -> str:
  """Legend label of one run: its name, encoding, any RoPE scaling applied at evaluation, and
  the result's notes (attention window, "no BCA", sliding stride)."""
  details = [] if result.get("posenc") == name else [str(result.get("posenc", "?"))]
  scaling = result.get("rope_scaling")
  if scaling:
    factor = scaling["factor"]
    details.append(
      f"{scaling['kind']} x{factor}"
      if isinstance(factor, str)
      else f"{scaling['kind']} x{factor:g}"
    )
  # The stride belongs to the sliding curves only: `plot_runs` puts it there.
  details.extend(n for n in result.get("notes", []) if not n.startswith("stride"))
  return f"{name} ({', '.join(details)})" if details else name


def _protocol_label(protocol: str, result: dict) -> str:
  strides = [n for n in result.get("notes", []) if n.startswith("stride")]
  return f"{protocol} ({strides[0]})" if protocol == "sliding" and strides else protocol


def plot_runs(runs: Sequence[tuple[str, dict, int]], path, *, title: str = "") -> epath.Path:
  """Draws perplexity against length (left) and loss by position (right) for several runs.

  A result's effective length (its "effective_length") is a star on the x axis under it, with a
  faint line of the protocol's style, and a note in its label; key-token perplexities (records'
  "key_tokens") are a dashed curve.

  Args:
    runs: (label, eval JSON dict, training length or 0 if unknown) per run.
    path: output PNG path (local or gs://).
    title: figure title.

  Returns:
    The path written.
  """
  fig, (ax_len, ax_pos) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  if len(runs) > len(colors):  # more runs than the 10 default colours: no two lines share one
    colors = list(plt.get_cmap("tab20").colors)
  all_lengths, train_lengths = set(), set()
  has_positions = False
  rules = {}  # legend entries of the effective-length rules drawn, each once
  ppls = []  # every perplexity drawn, for the choice of a log axis
  for i, (label, result, train_length) in enumerate(runs):
    color = colors[i % len(colors)]
    protocols = dict.fromkeys(r["protocol"] for r in result["records"])
    for protocol in protocols:
      points = sorted(
        (r["length"], r["ppl"])
        for r in result["records"]
        if r["protocol"] == protocol and "skipped" not in r and math.isfinite(r["ppl"])
      )
      if not points:
        continue
      xs, ys = zip(*points, strict=True)
      all_lengths.update(xs)
      line_label = f"{label}, {_protocol_label(protocol, result)}"
      if len(protocols) == 1 and protocol == "nonoverlapping":
        line_label = label
      skipped = [r["length"] for r in result["records"] if "skipped" in r]
      if skipped:
        line_label += f" (skipped L>={min(skipped)})"
      effective = result.get("effective_length")
      found = effective.get(protocol) if effective else None
      if found is not None:
        line_label += f", effective L={found['length'] or 'none'}"
        rules.setdefault(rule_label(effective["rule"], perplexity=True))
      style = PROTOCOL_STYLES.get(protocol, {})
      ax_len.plot(xs, ys, color=color, label=line_label, markersize=4, **style)
      ppls.extend(ys)
      if found is not None and found["length"] in xs:
        mark_effective_length(ax_len, found["length"], color, style.get("linestyle", "-"))
      key_points = [
        (r["length"], r["key_tokens"]["ppl"])
        for r in result["records"]
        if r["protocol"] == protocol and (r.get("key_tokens") or {}).get("ppl") is not None
      ]
      if key_points:  # LongPPL's key-token perplexity (eval.py --key_tokens)
        kx, ky = zip(*key_points, strict=True)
        ppls.extend(ky)
        ax_len.plot(kx, ky, color=color, linestyle="--", marker="^", markersize=4, alpha=0.7,
                    label=f"{label}, key tokens")  # fmt: skip
    if train_length:
      train_lengths.add(train_length)
    per_position = result.get("per_position")
    if per_position and per_position.get("loss"):
      losses = per_position["loss"]
      bin_width = per_position["length"] / len(losses)
      pts = [((j + 0.5) * bin_width, v) for j, v in enumerate(losses) if v is not None]
      if pts:
        xs, ys = zip(*pts, strict=True)
        ax_pos.plot(xs, ys, color=color, linewidth=1, label=f"{label}, L={per_position['length']}")
        has_positions = True

  for rule in rules:
    ax_len.plot([], [], "*", color="0.4", markersize=10, linestyle="none", label=rule)
  for j, train_length in enumerate(sorted(train_lengths)):
    for ax in (ax_len, ax_pos):
      label = "training length" if j == 0 else None
      ax.axvline(train_length, color="gray", linestyle="--", linewidth=1, label=label)
  ax_len.set_xscale("log", base=2)
  if all_lengths:
    ticks = sorted(all_lengths)
    ax_len.set_xticks(ticks, [str(t) for t in ticks])
    ax_len.xaxis.set_minor_locator(ticker.NullLocator())
  if ppls and max(ppls) > 4 * min(ppls):
    # Extrapolation failures blow up by orders of magnitude; a log axis keeps the rest readable.
    ax_len.set_yscale("log")
    ax_len.set_ylabel("perplexity (log scale)")
    # Label minor ticks at 2x and 5x: a span under two decades otherwise shows one number.
    ax_len.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs=(2, 5)))
    ax_len.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
  ax_len.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
  ax_len.set_xlabel("context length (tokens, log2 scale)")
  if ax_len.get_yscale() != "log":
    ax_len.set_ylabel("perplexity")
  ax_len.set_title("perplexity vs evaluation length")
  ax_len.grid(True, which="major", alpha=0.3)
  place_legend(fig, ax_len)
  ax_pos.set_xlabel("position in window")
  ax_pos.set_ylabel("mean loss (nats)")
  protocols = {
    (r.get("per_position") or {}).get("protocol", "") for _, r, *_ in runs if r.get("per_position")
  } - {""}
  windows = f", {'/'.join(sorted(protocols))} windows" if protocols else ""
  # Two lines: in one, the note runs past the panel's half of the default 12-inch figure.
  ax_pos.set_title(f"loss by position in the window\n(longest length{windows})")
  ax_pos.grid(True, alpha=0.3)
  if has_positions:
    place_legend(fig, ax_pos)
  if title:
    fig.suptitle(title)
  return save_figure(fig, path)


def mark_effective_length(ax, length: int, color, linestyle: str) -> None:
  """A star on the x axis under the effective length and a faint line of the curve's style
  behind the curves: a star on the curve itself would hide the point it marks."""
  ax.axvline(length, color=color, linestyle=linestyle, linewidth=1, alpha=0.5, zorder=1)
  ax.plot(
    [length], [0.0], "*", color=color, markersize=14, zorder=5, clip_on=False,
    transform=ax.get_xaxis_transform(),  # x in data, y in axes fractions: 0 is the x axis
  )  # fmt: skip


def save_figure(fig, path) -> epath.Path:
  """Writes `fig` as a PNG through epath (so gs:// works) and closes it."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=120)
  plt.close(fig)
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(buffer.getvalue())
  return path


def compare_runs(sources: Sequence[str], plot, *, name: str = DEFAULT_NAME) -> epath.Path:
  """Draws several runs' eval JSON in one plot.

  Args:
    sources: workdirs (their DIR/eval/NAME.json is read), eval.py --out_dir directories (their
      NAME.json) or paths of eval JSON files.
    plot: output PNG path.
    name: NAME of the JSON read from each directory.

  Returns:
    The PNG path.
  """
  runs = [
    (run_label(folder.name, result), result, training_length(run_of(folder, result)))
    for folder, result in read_results(sources, name, hint="")
  ]
  return plot_runs(runs, plot)


def split_sources(values: Sequence[str]) -> list[str]:
  """eval.py --compare's values (the flag may repeat) as sources, split at commas; a path may
  hold a comma: of the pieces left to place, the most that join into an existing path make one."""
  sources = []
  for value in values:
    parts = value.split(",")
    start = 0
    while start < len(parts):
      ends = range(len(parts), start, -1)
      end = next((e for e in ends if epath.Path(",".join(parts[start:e]).strip()).exists()), None)
      if end is None:
        if parts[start].strip():
          raise FileNotFoundError(f"--compare={value}: {parts[start].strip()} does not exist")
        end = start + 1  # an empty piece: a trailing or doubled comma
      elif ",".join(parts[start:end]).strip():
        sources.append(",".join(parts[start:end]).strip())
      start = end
  if not sources:
    raise ValueError("--compare is empty: give workdirs or eval JSON files, --compare=DIR1,DIR2")
  return sources


def read_results(sources: Sequence[str], name: str, *, hint: str) -> list[tuple]:
  """(directory, JSON dict) of each source: a workdir (its DIR/eval/NAME.json), a directory of
  results (eval.py --out_dir: its NAME.json) or a JSON path; the directory names the curve.

  `hint` completes the eval.py command the error suggests when a JSON is missing.
  """
  results = []
  for source in sources:
    path = epath.Path(source)
    if path.suffix == ".json":
      folder = path.parent.parent if path.parent.name == "eval" else path.parent
    else:
      folder = path
      found = [p for p in (path / "eval" / f"{name}.json", path / f"{name}.json") if p.exists()]
      path = found[0] if found else path / "eval" / f"{name}.json"
    if not path.exists():
      raise FileNotFoundError(_missing_result(path, folder, hint))
    results.append((folder, json.loads(path.read_text())))
  return results


def _missing_result(path: epath.Path, folder: epath.Path, hint: str) -> str:
  """Why `path` cannot be drawn: the results its directory holds under other names (another
  evaluation's, e.g. other lengths), else the eval.py command that makes it."""
  # A workdir's results are in DIR/eval/; an --out_dir's beside it (a run's own directory, with
  # its config.json and tokenizer.json, is not one).
  folders = [folder / "eval"] + ([] if (folder / "config.json").exists() else [folder])
  others = sorted(p.stem for d in folders if d.is_dir() for p in d.glob("*.json"))
  if others:
    return (
      f"{path} does not exist; {folder} has the results {', '.join(others)}: pass --out=NAME "
      "to draw one of them"
    )
  return f"{path} does not exist: run `python eval.py --workdir={folder}{hint}` first"


def run_of(folder: epath.Path, result: dict) -> epath.Path:
  """The directory of the run a result scores: the one it records when it was written away from
  its run (eval.py --out_dir, --hf_model), else the directory it was read from."""
  return epath.Path(result.get("workdir") or result.get("hf_model") or folder)


def training_length(workdir) -> int:
  """data.seq_len from DIR/config.json (an imported model's max_position_embeddings from its
  config.json), or 0 for a JSON copied away from its run."""
  values = workdir_lib.read_config_json(workdir)
  if values is None:
    return 0
  if "data" not in values:  # a Hugging Face config.json
    return int(values.get("max_position_embeddings") or 0)
  return int(values["data"].get("seq_len", 0))
