"""The commands of README.md and docs/ run as written.

Every `python train.py | eval.py | generate.py | -m MODULE ...` command in a ```bash or ```sh block
is parsed by its own command-line parser (absl flags with the config file and its `--config.*`
overrides, or argparse) without running the job: a misspelt flag or config field fails here. The
cheap ones (CHEAP: listings, `--help`) also run as a user runs them. docs/reference/config.md is
what `python -m configs.reference` writes.

Run as a script (`python tests/docs_commands_test.py < commands.json`), this file is the parser
check itself: one fresh interpreter parses every command, so the tests' own flags and imports
never mix with the command lines'.
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^[ \t]*```(?:bash|sh)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
SEPARATORS = {"&&", "||", ";", "|", "&"}
# Modules whose commands are not parsed here: other tools' own command lines.
NOT_OURS = {"pip", "pytest", "venv"}
# The packages whose modules may define flags when imported (absl's own are never forgotten).
OURS = {"roformer", "benchmarks", "experiments", "configs"}
# Run as subprocesses (beyond any command with --help): cheap listings. configs.reference writes
# into a temporary file instead of docs/reference/config.md.
CHEAP = {("-m", "roformer.posenc"), ("-m", "configs.reference")}
# A Hugging Face directory the parse puts in place of HF_DIR, so that configs/hf_decoder.py:HF_DIR
# loads: the Llama fixture with a tokenizer.json.
HF_FIXTURE = REPO / "tests" / "fixtures" / "hf_llama_tiny"
# Commands run from a user's own project (docs/extending.md), which tests/extending_test.py runs.
ELSEWHERE = "/path/to/"


def _logical_lines(block: str):
  """The block's lines, continuation lines joined and quoted newlines kept inside their line."""
  pending = ""
  for line in block.replace("\\\n", " ").splitlines():
    pending = f"{pending}\n{line}" if pending else line
    try:
      shlex.split(pending, comments=True)
    except ValueError:  # an open quote: the command goes on
      continue
    yield pending
    pending = ""
  if pending:
    yield pending


def _commands(line: str):
  lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  lexer.commenters = "#"
  command: list[str] = []
  for token in lexer:
    if token in SEPARATORS:
      yield command
      command = []
    else:
      command.append(token)
  yield command


def python_commands() -> list[tuple[str, list[str]]]:
  """(where, argv after `python`) of every python command of README.md and docs/**/*.md."""
  out = []
  for path in DOCS:
    text = path.read_text()
    for block in FENCE.finditer(text):
      first = text.count("\n", 0, block.start()) + 2
      for line in _logical_lines(textwrap.dedent(block.group(1))):
        for command in _commands(line):
          while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", command[0]):
            command = command[1:]  # JAX_PLATFORMS=cpu python ...
          if not command or command[0] not in ("python", "python3"):
            continue
          argv = command[1:]
          if not argv or any(ELSEWHERE in a for a in argv):
            continue
          if argv[0] == "-m" and argv[1].split(".")[0] in NOT_OURS:
            continue
          out.append((f"{path.relative_to(REPO)}:{first}", argv))
  return out


def _cheap(argv: list[str]) -> bool:
  return tuple(argv[:2]) in CHEAP or "--help" in argv


# ---- the parser check, in a fresh interpreter ----


class _Parsed(Exception):
  """Raised in place of running the job once its command line has parsed."""


def _parse_all(commands: list[list[str]], hf_dir: str) -> list[str]:
  """'' for each command whose flags its parser accepts, else what the parser said."""
  import argparse
  import contextlib
  import io
  import runpy

  from absl import app, flags

  fv = flags.FLAGS

  def run_parses_only(main, argv=None, flags_parser=None, **_):
    (flags_parser or fv)(argv or sys.argv)
    raise _Parsed

  parse_args = argparse.ArgumentParser.parse_args

  def parse_args_only(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise _Parsed

  os.chdir(REPO)  # the repository's modules import from PYTHONPATH (the test sets it)
  app.define_help_flags()  # as app.run does (--help, --helpfull, ...), once
  baseline = set(fv)
  results = []
  for argv in commands:
    # Patched before every command (on the module as imported now), so that no command line
    # ever runs its job here.
    sys.modules["absl.app"].run = run_parses_only
    argparse.ArgumentParser.parse_args = parse_args_only
    argv = [re.sub(r"(^|[=:])HF_DIR$", lambda m: m.group(1) + hf_dir, a) for a in argv]
    said = io.StringIO()
    try:
      with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
        if argv[0] == "-m":
          sys.argv = [argv[1], *argv[2:]]
          runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
          sys.argv = list(argv)
          runpy.run_path(str(REPO / argv[0]), run_name="__main__")
      results.append("the command ran to its end instead of parsing its flags")
    except _Parsed:
      results.append("")
    except SystemExit as e:
      results.append(f"exit {e.code}: {said.getvalue().strip()[-600:]}")
    except Exception as e:  # noqa: BLE001 (a flags.Error, an ImportError, a config file's error)
      results.append(f"{type(e).__name__}: {e}"[-600:])
    # The next command defines its CLI's flags afresh: drop every flag this one defined (its
    # CLI's, its config overrides, a library module's), and forget the modules that defined them
    # at import so that they define them again when imported.
    fv.unparse_flags()
    for name in set(fv) - baseline:
      module = fv.find_module_defining_flag(name) or ""
      delattr(fv, name)
      if module.split(".")[0] in OURS and module in sys.modules:
        parent, _, child = module.rpartition(".")
        del sys.modules[module]
        if parent in sys.modules and hasattr(sys.modules[parent], child):
          delattr(sys.modules[parent], child)
  return results


# ---- the tests ----


# Negative controls parsed beside the docs' commands: each must fail, naming its misspelling.
MISSPELT = {
  "lenghts": ["eval.py", "--workdir=DIR", "--lenghts=256"],
  "num_layerz": [
    "train.py",
    "--config=configs/lm.py",
    "--workdir=DIR",
    "--config.model.num_layerz=2",
  ],
  "scael": ["-m", "experiments.extrapolation", "--scael=cpu"],
}
# The same command lines spelt right: each must parse.
SPELT = [
  ["eval.py", "--workdir=DIR", "--lengths=256"],
  ["train.py", "--config=configs/lm.py", "--workdir=DIR", "--config.model.num_layers=2"],
  ["-m", "experiments.extrapolation", "--scale=cpu"],
]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict[tuple[str, ...], str]:
  """What the parser said of each docs command and each MISSPELT control, in one fresh
  interpreter ('' = accepted)."""
  from tokenizers import Tokenizer, models

  tmp_path = tmp_path_factory.mktemp("docs_commands")
  hf_dir = tmp_path / "hf_llama"
  shutil.copytree(HF_FIXTURE, hf_dir)
  vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *"abcdefghij "])}
  (hf_dir / "tokenizer.json").write_text(
    Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).to_str()
  )
  # `--help` prints and exits instead of parsing a command line: the cheap test runs it.
  commands = [argv for _, argv in python_commands() if "--help" not in argv]
  commands = list(dict.fromkeys(map(tuple, [*commands, *MISSPELT.values(), *SPELT])))
  done = subprocess.run(
    [sys.executable, __file__],
    input=json.dumps({"commands": commands, "hf_dir": str(hf_dir)}),
    capture_output=True,
    text=True,
    env={
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      "ROFORMER_CACHE": str(tmp_path / "cache"),
      "PYTHONPATH": str(REPO),
    },
    timeout=300,
    cwd=REPO,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return dict(zip(commands, json.loads(done.stdout.strip().splitlines()[-1]), strict=True))


def test_every_python_command_of_the_docs_parses(parsed):
  commands = [(where, argv) for where, argv in python_commands() if "--help" not in argv]
  assert len(commands) > 30, f"only {len(commands)} commands found in README.md and docs/"
  failed = [
    f"{where}: python {shlex.join(argv)}\n    {parsed[tuple(argv)]}"
    for where, argv in commands
    if parsed[tuple(argv)]
  ]
  assert not failed, "commands whose flags do not parse:\n" + "\n".join(failed)


def test_a_misspelt_flag_or_config_field_fails_the_parse(parsed):
  for misspelling, argv in MISSPELT.items():
    assert misspelling in parsed[tuple(argv)], (argv, parsed[tuple(argv)])
  for argv in SPELT:  # the controls fail for their misspelling alone
    assert parsed[tuple(argv)] == "", (argv, parsed[tuple(argv)])


def test_the_cheap_commands_run(tmp_path):
  cheap = [(where, argv) for where, argv in python_commands() if _cheap(argv)]
  assert any(argv[:2] == ["-m", "roformer.posenc"] for _, argv in cheap)
  assert any(argv[:2] == ["-m", "configs.reference"] for _, argv in cheap)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for argv, where in {tuple(argv): where for where, argv in cheap}.items():
    argv = list(argv)
    if argv[:2] == ["-m", "configs.reference"]:
      argv = [*argv, f"--out={tmp_path / 'config.md'}"]
    done = subprocess.run(
      [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )
    # absl's --help prints the flags and exits 1.
    ok = {0, 1} if "--help" in argv else {0}
    assert done.returncode in ok, f"{where}: python {shlex.join(argv)}\n{done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{where}: python {shlex.join(argv)} printed nothing"
  assert (tmp_path / "config.md").read_text() == (REPO / "docs/reference/config.md").read_text()


def test_config_reference_is_generated_from_the_config():
  from configs import reference

  committed = (REPO / "docs" / "reference" / "config.md").read_text()
  assert reference.markdown() == committed, (
    "docs/reference/config.md is not what configs/default.py and the encodings declare: "
    "run `python -m configs.reference` and commit the page"
  )


def test_the_extraction_sees_flags_and_overrides():
  block = textwrap.dedent("""\
    JAX_PLATFORMS=cpu python train.py --config=configs/lm.py --workdir=DIR \\
      --config.posenc.kind=alibi  # a comment
    pip install -e . && python eval.py --workdir=DIR --lengths=256,512
    """)
  found = [c for line in _logical_lines(block) for c in _commands(line)]
  assert [
    "JAX_PLATFORMS=cpu",
    "python",
    "train.py",
    "--config=configs/lm.py",
    "--workdir=DIR",
    "--config.posenc.kind=alibi",
  ] in found
  assert ["python", "eval.py", "--workdir=DIR", "--lengths=256,512"] in found


if __name__ == "__main__":
  given = json.load(sys.stdin)
  print(json.dumps(_parse_all(given["commands"], given["hf_dir"])))
