"""Tests of the repository itself: pinned dependencies, self-contained documentation."""

import ast
import re
import sys
from pathlib import Path

from roformer.testing import REPO

# Import names whose distribution is named otherwise.
DISTRIBUTIONS = {
  "absl": "absl-py", "ml_collections": "ml-collections", "orbax": "orbax-checkpoint",
  "tensorboardX": "tensorboardx", "huggingface_hub": "huggingface-hub", "ml_dtypes": "ml-dtypes",
  "yaml": "pyyaml",
}  # fmt: skip


def _pinned() -> set[str]:
  names = set()
  for line in (REPO / "requirements.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      assert "==" in line, f"requirements.txt: {line!r} is not pinned"
      names.add(line.split("==")[0].lower())
  return names


def _imports(path: Path) -> set[str]:
  tree = ast.parse(path.read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module.split(".")[0])
  return names


def test_every_third_party_module_the_package_imports_is_pinned():
  local = {"roformer", "configs"}
  imported = set()
  for path in [*(REPO / "roformer").rglob("*.py"), *REPO.glob("*.py")]:
    imported |= _imports(path)
  third_party = {m for m in imported - local if m not in sys.stdlib_module_names}
  pinned = _pinned()
  missing = sorted(m for m in third_party if DISTRIBUTIONS.get(m, m).lower() not in pinned)
  assert not missing, f"imported but not pinned in requirements.txt: {missing}"


def test_documentation_refers_only_to_files_in_the_repository():
  # The design a reader needs is in docs/; nothing points to a file outside the repository.
  for path in [*REPO.rglob("*.py"), *REPO.rglob("*.md")]:
    if "results" in path.parts or ".git" in path.parts or path == Path(__file__):
      continue
    text = path.read_text(errors="ignore")
    assert not re.search(r"\bDESIGN\.md\b", text), f"{path.relative_to(REPO)} refers to DESIGN.md"
