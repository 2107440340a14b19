"""The results pages: results/<grid>/README.md, made from the grid's committed run JSONs and the
prose of its notes.md, so that every number on the page is what the JSONs give.

notes.md is markdown with two kinds of directive:

  {{table SCALE HEADING}}  the first table under the heading of SCALE/table.md (`.`: the grid's own
                           table.md) whose text starts with HEADING, verbatim, marked with the
                           comment `<!-- from results/<grid>/<scale>/table.md -->`;
  {{NAME ARG ...}}         a number from the run JSONs: experiments/page_values.py's value NAME
                           of this grid (or <grid>.NAME of another) called with the ARGs.

Images and links are ordinary markdown, relative to the page; each must exist.

  python -m experiments.report results/mlm [results/synthetic ...]   # no argument: every grid

rewrites each grid's results.csv, table.md, plots and README.md from its JSONs (no training), as
the grid's driver does after each run; tests/e2e/results_test.py checks the committed files are
what this gives.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import textwrap

from experiments import page_values

GRIDS = ("mlm", "extrapolation", "extension", "synthetic")
SCALED = ("mlm", "extrapolation", "extension")  # a subdirectory per corpus
DIRECTIVE = re.compile(r"\{\{([^{}]+)\}\}")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def command(grid_name: str) -> str:
  return f"python -m experiments.report results/{grid_name}"


def scales(grid_dir: pathlib.Path) -> list[str]:
  """The corpus subdirectories of a grid (those with a table.md); ["."] for a grid without."""
  if grid_dir.name not in SCALED:
    return ["."]
  return sorted(p.parent.name for p in grid_dir.glob("*/table.md"))


def regenerate(source: pathlib.Path, out: pathlib.Path, *, draw: bool = True) -> None:
  """Writes the report of the grid at `source` (results/<grid>) from its run JSONs into `out`:
  each scale's results.csv, tasks.csv, table.md and (if `draw`) plots, then README.md."""
  for scale in scales(source):
    (out / scale).mkdir(parents=True, exist_ok=True)
    _regenerate_scale(source / scale, out / scale, source.name, draw)
  write_page(source, out)


def _regenerate_scale(directory: pathlib.Path, out: pathlib.Path, grid_name: str, draw: bool):
  from experiments import extension, extension_report, extrapolation, grid, mlm, report, synthetic

  if grid_name == "synthetic":
    results = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    synthetic.write_summaries(str(out), results, draw=draw)
    return
  scale, seq_len = report.read_header(directory)
  if grid_name == "extension":
    runs = extension.perplexity_runs(extrapolation.SCALES[scale], set())
    task_scale = extension.TASK_SCALES[scale]
    tasks = {
      task: grid.finished_records(extension.task_runs(task_scale, task, set()), directory / "tasks")
      for task in task_scale.tasks
    }
    records = grid.finished_records(runs, directory)
    if not records:
      raise ValueError(f"{directory}: no run JSONs")
    extension_report.write_extension(records, tasks, out, seq_len=seq_len, scale=scale, draw=draw)
    return
  if grid_name == "extrapolation":
    runs = extrapolation.grid_runs(extrapolation.SCALES[scale], set())
    write = report.write_extrapolation
  else:
    runs, write = mlm.grid_runs(mlm.SCALES[scale], set()), report.write_mlm
  records = grid.finished_records(runs, directory)
  if not records:
    raise ValueError(f"{directory}: no run JSONs")
  write(records, out, seq_len=seq_len, scale=scale, draw=draw)


def write_page(source: pathlib.Path, out: pathlib.Path) -> None:
  """out/README.md from source/notes.md, the tables in out/<scale>/table.md and the numbers of
  the JSONs under source (results/<grid>)."""
  (out / "README.md").write_text(render_page(source, out))


def render_page(source: pathlib.Path, out: pathlib.Path) -> str:
  """The page's text: its header (how it is made), then notes.md with its directives filled in
  and its prose re-wrapped; a directive or link that cannot be filled names its line."""
  grid_name = source.name
  notes = (source / "notes.md").read_text()
  tables = {scale: (out / scale / "table.md").read_text() for scale in scales(source)}
  values = page_values.namespace(grid_name, source.parent)
  title, _, body = notes.partition("\n")
  where = " and ".join(f"`{s}/`" for s in scales(source)) if grid_name in SCALED else "this folder"
  header = [
    title,
    "",
    f"*Generated from the run JSONs in {where} and the prose of [notes.md](notes.md) by "
    f"`{command(grid_name)}`, which rewrites this page, the tables, CSVs and plots without "
    "training; edit notes.md, not this file, and rerun that command whenever a run JSON changes "
    "(`tests/e2e/results_test.py` fails until the page is what the JSONs give).*",
  ]
  lines = []
  for number, line in enumerate(body.splitlines(), start=2):
    try:
      lines.append(_render_line(line, values, tables, grid_name))
    except (ValueError, KeyError, TypeError, IndexError) as e:
      raise ValueError(f"{source}/notes.md line {number}: {e}") from e
    for target in LINK.findall(line):
      if "://" not in target and not target.startswith("#") and not _exists(source / target):
        raise ValueError(f"{source}/notes.md line {number}: no file {target}")
  return "\n".join(reflow(header + lines)) + "\n"


def reflow(lines: list[str], width: int = 100) -> list[str]:
  """Prose paragraphs and list items re-wrapped at `width` once their numbers are in (a number
  is not as long as its directive); tables, headings, images, comments and code as they are."""
  out, paragraph, in_code = [], [], False

  def flush():
    if paragraph:
      bullet = paragraph[0].startswith("- ")
      text = " ".join(line.strip() for line in paragraph)
      text = text[2:] if bullet else text
      # Inline code is not broken across lines: its spaces are held as NUL while wrapping.
      text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
      wrapped = [
        line.replace("\0", " ")
        for line in textwrap.wrap(
          text, width, initial_indent="- " if bullet else "",
          subsequent_indent="  " if bullet else "", break_long_words=False,
          break_on_hyphens=False,
        )
      ]  # fmt: skip
      out.extend(wrapped)
      paragraph.clear()

  for line in lines:
    if line.startswith("```"):
      flush()
      in_code = not in_code
      out.append(line)
    elif in_code or not line.strip() or line.startswith(("|", "#", "<!--", "![")):
      flush()
      out.append(line)
    else:
      if line.startswith("- "):
        flush()
      paragraph.append(line)
  flush()
  return out


def _exists(path: pathlib.Path) -> bool:
  """A link's target exists, or is another grid's page (made from the notes.md beside it)."""
  path = pathlib.Path(str(path).split("#")[0])
  return path.exists() or (path.name == "README.md" and (path.parent / "notes.md").exists())


def _render_line(line: str, values: dict, tables: dict, grid_name: str) -> str:
  def replace(match: re.Match) -> str:
    name, *args = match.group(1).split()
    if name == "table":
      return _table(tables, grid_name, args[0], " ".join(args[1:]))
    if name not in values:
      raise ValueError(f"unknown value {name!r} in {match.group(0)}")
    return values[name](*args)

  return DIRECTIVE.sub(replace, line)


def _table(tables: dict, grid_name: str, scale: str, heading: str) -> str:
  """The first table under the heading of `scale`'s table.md that starts with `heading`."""
  if scale not in tables:
    raise ValueError(f"no table.md for scale {scale!r}")
  lines = tables[scale].splitlines()
  starts = [
    i
    for i, line in enumerate(lines)
    if line.startswith("#") and line.lstrip("# ").startswith(heading)
  ]
  if not starts:
    raise ValueError(f"{scale}/table.md has no heading starting {heading!r}")
  rows = []
  for line in lines[starts[0] + 1 :]:
    if line.startswith("|"):
      rows.append(line)
    elif rows or line.startswith("#"):
      break
  if not rows:
    raise ValueError(f"{scale}/table.md: no table under {heading!r}")
  source = "/".join(p for p in ("results", grid_name, scale, "table.md") if p != ".")
  return "\n".join([f"<!-- from {source} -->", *rows])


def page_of(out: pathlib.Path) -> pathlib.Path | None:
  """The grid directory whose page a driver writing to `out` refreshes: results/<grid> when `out`
  is one of its scales (or the grid itself) and the grid has notes.md; None otherwise."""
  for candidate in (out, out.parent):
    if candidate.name in GRIDS and (candidate / "notes.md").exists():
      if candidate.name in SCALED and candidate == out:
        continue
      return candidate
  return None


def refresh_page(out: pathlib.Path) -> None:
  """After a driver rewrote `out`'s report: rewrites its grid's README.md if `out` is a committed
  grid's (a page that cannot be made says why, and the grid goes on)."""
  page = page_of(out)
  if page is None:
    return
  try:
    write_page(page, page)
  except ValueError as e:
    print(f"{page}/README.md not rewritten: {e}", file=sys.stderr)


def main(argv: list[str]) -> None:
  results = pathlib.Path(__file__).resolve().parents[1] / "results"
  targets = [pathlib.Path(a) for a in argv] or [results / g for g in GRIDS]
  for target in targets:
    if target.name not in GRIDS or not target.is_dir():
      raise SystemExit(f"{target}: not a grid directory (results/<{'|'.join(GRIDS)}>)")
    regenerate(target, target)
    print(f"wrote {target}/README.md and the tables, CSVs and plots of {', '.join(scales(target))}")


if __name__ == "__main__":
  main(sys.argv[1:])
