"""Every relative link of README.md, docs/ and results/ reaches a file, and every #anchor a heading
of it (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered)."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
CODE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.M | re.S)
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
LINK = re.compile(r"\]\(([^)\s#]*)(#[^)\s]+)?\)")


def anchor(heading: str) -> str:
  """GitHub's anchor of a heading's text."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
  """The anchors of a Markdown text's headings (outside code blocks); repeats get -1, -2, ..."""
  seen: dict[str, int] = {}
  out = set()
  for m in HEADING.finditer(CODE.sub("", text)):
    name = anchor(m.group(1))
    n = seen.get(name, 0)
    seen[name] = n + 1
    out.add(name if n == 0 else f"{name}-{n}")
  return out


def broken_links(doc: pathlib.Path) -> list[str]:
  """The relative links of `doc` whose file or heading does not exist."""
  broken = []
  for m in LINK.finditer(CODE.sub("", doc.read_text())):
    target, fragment = m.group(1), m.group(2)
    if re.match(r"[a-z]+:", target):  # https:, mailto:
      continue
    path = (doc.parent / target).resolve() if target else doc
    if not path.exists():
      broken.append(target)
    elif fragment and path.suffix == ".md" and fragment[1:] not in anchors(path.read_text()):
      broken.append(target + fragment)
  return broken


def test_headings_give_githubs_anchors():
  text = "# Set-up\n## Checking a machine: `python -m benchmarks.gpu_check`\n## Set-up\n"
  text += "```\n# not a heading\n```\n"
  assert anchors(text) == {
    "set-up",
    "checking-a-machine-python--m-benchmarksgpu_check",
    "set-up-1",
  }


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path):
  (tmp_path / "other.md").write_text("# Memory of the fused kernels\n")
  doc = tmp_path / "doc.md"
  doc.write_text(
    "[a](other.md#memory-of-the-fused-kernels) [b](other.md#memory) [c](gone.md) "
    "[d](#here) [e](https://example.com/x.md#y)\n# Here\n"
  )
  assert broken_links(doc) == ["other.md#memory", "gone.md"]


def test_every_link_of_the_docs_resolves():
  docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
  docs += sorted((REPO / "results").rglob("*.md"))
  broken = {str(doc.relative_to(REPO)): b for doc in docs if (b := broken_links(doc))}
  assert not broken, broken
