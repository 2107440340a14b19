"""The package layering of roformer/: imports point one way and form no circle.

Every import counts, module level or inside a function (a local import is still a dependency);
only imports under `if TYPE_CHECKING:` are left out, since they never run.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

from roformer import testing

ROOT = pathlib.Path(__file__).resolve().parent.parent / "roformer"

# What each unit may import besides itself (a unit is a top-level module or package of roformer/).
# A dotted entry allows that module only, e.g. the config takes the mesh config from the sharding
# and reads config.json with the workdir's reader (and a Hugging Face decoder's training length
# with the importer's list of decoder types), and training scores perplexity with the
# evaluation's scorer, nothing else of those packages.
ALLOWED = {
  "errors": set(),
  "fields": set(),
  "posenc": {"errors", "fields"},
  "data": {"errors", "fields"},
  "infra": {"errors", "fields"},
  "nn": {"posenc", "errors", "fields"},
  "hf": {"nn", "posenc", "errors"},
  "config": {
    "nn",
    "data",
    "posenc",
    "infra.sharding",
    "infra.workdir",
    "hf.decoders",
    "errors",
    "fields",
  },  # fmt: skip
  "runs": {"config", "infra", "nn", "data", "posenc", "hf", "errors"},
  "generate": {"runs", "config", "nn", "data", "posenc", "errors"},
  "evals": {"runs", "config", "infra", "nn", "data", "posenc", "errors"},
  "train": {"config", "infra", "data", "nn", "posenc", "hf", "evals.perplexity", "errors"},
  "testing": {"generate", "config", "nn", "data", "posenc", "errors"},
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
  """The longest prefix of `name` that is a module of roformer/."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    if ".".join(parts[:end]) in MODULES:
      return ".".join(parts[:end])
  return None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
  skipped = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
  return skipped


def imports_of(module: str) -> set[str]:
  """The roformer modules `module` imports (a name imported from a package resolves to its
  submodule when it is one)."""
  tree = ast.parse(MODULES[module].read_text())
  skipped = _type_checking_nodes(tree)
  found = set()
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module.split(".")[0] == "roformer":
        for alias in node.names:
          found.add(_resolve(f"{node.module}.{alias.name}") or _resolve(node.module))
    elif isinstance(node, ast.Import):
      found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "roformer"}
  found.discard(None)
  found.discard(module)
  return found


def _unit(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _allowed(source: str, target: str) -> bool:
  unit, target_unit = _unit(source), _unit(target)
  if target == "roformer" or unit == target_unit:
    return True
  rules = ALLOWED.get(unit)
  assert rules is not None, f"{source}: roformer/{unit} has no layering rule in ALLOWED"
  short = target.removeprefix("roformer.")
  return target_unit in rules or any(short == r or short.startswith(r + ".") for r in rules)


def test_every_unit_has_a_layering_rule():
  units = {_unit(m) for m in MODULES} - {""}
  assert units <= set(ALLOWED), f"units without a rule: {sorted(units - set(ALLOWED))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
  wrong = sorted(t for t in imports_of(module) if not _allowed(module, t))
  assert not wrong, f"{module} imports {wrong}, against ALLOWED[{_unit(module)!r}]"


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One import circle of `graph` as a path [a, b, ..., a], or [] if there is none."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    state[node] = "done"
    stack.pop()
    return []

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return []


def test_no_import_circle():
  graph = {m: imports_of(m) for m in MODULES}
  # A package's __init__ may gather its own submodules; a submodule importing its package's
  # __init__ back is then a circle like any other.
  cycle = find_cycle(graph)
  assert not cycle, "import circle: " + " -> ".join(cycle)


def test_the_checks_catch_a_violation_and_a_circle():
  # Negative controls: the rules refuse what the layering forbids, and the search finds circles.
  assert not _allowed("roformer.posenc.rope", "roformer.nn.model")
  assert not _allowed("roformer.infra.sharding", "roformer.config")
  assert not _allowed("roformer.evals.ppl_vs_length", "roformer.train.loop")
  assert not _allowed("roformer.train.loop", "roformer.evals.ppl_vs_length")
  assert _allowed("roformer.train.loop", "roformer.evals.perplexity")
  assert not _allowed("roformer.nn.model", "roformer.testing")
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) == []
  # The reader sees real edges, local imports included, and skips TYPE_CHECKING ones.
  assert "roformer.evals.perplexity" in imports_of("roformer.train.loop")
  assert "roformer.data.sources" in imports_of("roformer.data.tokenizer")  # a local import
  assert "roformer.data.batches" in imports_of("roformer.data.corpus")
  assert "roformer.data.corpus" not in imports_of("roformer.data.batches")


# What the entry points import before they read a document: train.py (its tokens cached),
# eval.py and generate.py of a trained run, and scoring a Hugging Face decoder.
ENTRY_MODULES = (
  "roformer.train.loop", "roformer.evals.ppl_vs_length", "roformer.evals.spec",
  "roformer.evals.effective_length", "roformer.generate", "roformer.runs", "roformer.hf.decoders",
)  # fmt: skip


def test_the_entry_points_start_without_datasets_or_torch():
  # `datasets` takes about a second to import (pandas, pyarrow's datasets): the sources import it
  # where they read documents, so a run whose tokens are cached, eval.py and generate.py start
  # without it. torch and transformers are never imported (reference fixtures only).
  code = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]: importlib.import_module(name)\n"
    "print(sorted({'datasets', 'pandas', 'torch', 'transformers'} & set(sys.modules)))\n"
    # Reading documents imports it: the check sees an import where one happens.
    "from roformer.data import config, sources\n"
    f"cfg = config.DataConfig(source='files', files='{testing.CORPUS}/train/*.txt')\n"
    "assert len(sources.make_source(cfg).documents('train')) > 0\n"
    "print('datasets' in sys.modules)\n"
  )
  done = subprocess.run(
    [sys.executable, "-c", code, *ENTRY_MODULES],
    env=testing.subprocess_env(), capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout
