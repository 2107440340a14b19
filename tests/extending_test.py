"""An encoding and an attention kernel from the user's own modules: trained, resumed, evaluated
and sampled by the CLIs; and a user's mistakes there, each one line saying where.

The modules (docs/examples/gauss_bias.py, copied into a temporary directory, and a kernel) and a
config file that imports them live outside the repository, as in a researcher's own project;
nothing of the repository is edited. Their directory is on PYTHONPATH, as a user's package
would be.
"""

import json
import shutil
import subprocess
import sys

import pytest

from roformer import testing

EXAMPLE = testing.REPO / "docs" / "examples" / "gauss_bias.py"

CONFIG = """
{imports}
from configs import default


def get_config():
  config = default.get_config()
  config.posenc.kind = "gauss"
{field}
  return config
"""
WITH_IMPORT = {"imports": "import gauss_bias  # registers posenc.kind='gauss'", "field": ""}

SHORT = {
  **testing.TINY_TRAIN,
  "model.dropout_rate": 0.0,
  "train.num_train_steps": 4,
  "train.checkpoint_every_steps": 2,
  "train.eval_every_steps": 0,
  "train.log_every_steps": 1,
}


KERNEL_MODULE = """
from roformer.nn.attention.kernels import Kernel, register_kernel
from roformer.nn.attention.oracle import reference_attention

register_kernel(Kernel("mine", None, lambda features: None, reference_attention))
"""


def _project(tmp_path, **config):
  """The user's project: their encoding module and a config file that imports it."""
  shutil.copy(EXAMPLE, tmp_path / "gauss_bias.py")
  (tmp_path / "gauss_config.py").write_text(CONFIG.format(**config))
  return tmp_path


def _run(script, *args, cwd, timeout=600):
  env = testing.subprocess_env(PYTHONPATH=f"{cwd}:{testing.REPO}")
  return subprocess.run(
    [sys.executable, str(testing.REPO / script), *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _train(project, workdir, **overrides):
  settings = {**SHORT, **overrides}
  args = [f"--config={project / 'gauss_config.py'}", f"--workdir={workdir}"]
  return _run("train.py", *args, *testing.flag_args(settings), cwd=project)


def _repository_state() -> str:
  result = subprocess.run(
    ["git", "status", "--porcelain", "--untracked-files=all"],
    cwd=testing.REPO,
    capture_output=True,
    text=True,
  )
  return result.stdout if result.returncode == 0 else ""


def _records(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_an_encoding_and_a_kernel_of_the_users_own_train_resume_evaluate_and_generate(tmp_path):
  before = _repository_state()
  project = _project(
    tmp_path, imports=WITH_IMPORT["imports"] + "\nimport my_kernels",
    field="  config.posenc.gauss_init_sigma = 4.0\n  config.model.attention_impl = 'mine'",
  )  # fmt: skip
  (project / "my_kernels.py").write_text(KERNEL_MODULE)
  workdir = tmp_path / "run"
  result = _train(project, workdir, **{"model.attention_impl": "mine"})
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["posenc"]["kind"] == "gauss" and saved["posenc"]["gauss_init_sigma"] == 4.0
  assert saved["model"]["attention_impl"] == "mine"
  # What eval.py and generate.py import again: the encoding's module and the kernel's.
  assert saved["imports"] == ["gauss_bias", "my_kernels"]
  first = {r["step"]: r["train_loss"] for r in _records(workdir) if "train_loss" in r}
  assert sorted(first) == [1, 2, 3, 4]

  # A restart with more steps resumes from step 4; the field cannot change on resume.
  result = _train(project, workdir, **{"train.num_train_steps": 6, "model.attention_impl": "mine"})
  assert result.returncode == 0, result.stderr[-3000:]
  steps = [r["step"] for r in _records(workdir) if "train_loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # no step trained twice: it resumed
  changed = _train(
    project, workdir,
    **{"train.num_train_steps": 8, "posenc.gauss_init_sigma": 2.0, "model.attention_impl": "mine"},
  )  # fmt: skip
  assert changed.returncode != 0 and "posenc.gauss_init_sigma: 4.0 -> 2.0" in changed.stderr

  # eval.py and generate.py open the workdir by its config.json alone (no --config).
  result = _run(
    "eval.py",
    f"--workdir={workdir}",
    "--lengths=16,32",
    "--max_tokens=64",
    "--batch_size=4",
    "--protocol=nonoverlapping",
    "--out=gauss",
    cwd=project,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  scored = json.loads((workdir / "eval" / "gauss.json").read_text())
  assert scored["posenc"] == "gauss"
  assert [r["length"] for r in scored["records"]] == [16, 32]
  assert all(r["loss"] > 0 for r in scored["records"])
  result = _run(
    "generate.py", f"--workdir={workdir}", "--prompt=def ", "--max_new_tokens=8", cwd=project
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip()
  assert _repository_state() == before


def test_the_same_run_without_the_import_names_the_kind_and_how_to_register_it(tmp_path):
  project = _project(tmp_path, imports="", field="")
  result = _train(project, tmp_path / "run")
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1, result.stderr[-3000:]
  assert "posenc.kind='gauss' is not a registered encoding" in errors[0]
  assert "@roformer.posenc.register('gauss')" in errors[0]
  assert not (tmp_path / "run" / "config.json").exists()


def test_a_workdir_whose_encoding_module_is_gone_says_which_module_to_put_on_the_path(tmp_path):
  project = _project(tmp_path, **WITH_IMPORT)
  workdir = tmp_path / "run"
  result = _train(project, workdir, **{"train.num_train_steps": 1})
  assert result.returncode == 0, result.stderr[-3000:]
  (project / "gauss_bias.py").unlink()
  result = _run("eval.py", f"--workdir={workdir}", "--lengths=16", "--max_tokens=32", cwd=project)
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "module 'gauss_bias'" in result.stderr and "PYTHONPATH" in result.stderr


# Mistakes in a user's own project: each one line on stderr that says where, no traceback, and
# no run started. (config file text, the module the config imports or None, what the line says)
_OWN_MODULE = """
from roformer import posenc


@posenc.register("mistyped")
class Mistyped(posenc.PosEnc):
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Fields(posenc.PosEnc.Fields):
    mistyped_width: float = posenc.parm(1.0, "a typo of param")
"""
_INLINE_ENCODING = """
import jax.numpy as jnp
from roformer import posenc


@posenc.register("inline")
class Inline(posenc.PosEnc):
  def bias(self, qpos_BL, kpos_BS):
    return jnp.zeros((qpos_BL.shape[0], self.num_heads, qpos_BL.shape[1], kpos_BS.shape[1]))
"""
_MISTAKES = {
  "field_without_the_import": (
    CONFIG.format(imports="", field="  config.posenc.gauss_init_sigma = 4.0"), None,
    ["posenc.gauss_init_sigma is not a config field", "import it in the config file"],
  ),
  "misspelt_field_in_the_file": (
    CONFIG.format(field="  config.model.num_layerz = 2", **{"imports": WITH_IMPORT["imports"]}),
    None, ["model.num_layerz is not a config field", 'Did you mean "num_layers"'],
  ),
  "misspelt_nested_field": (
    CONFIG.format(field="  config.posenc.scaling.factr = 2.0", **{"imports": ""}), None,
    ["posenc.scaling.factr is not a config field", 'Did you mean "factor"'],
  ),
  "misspelt_group": (
    CONFIG.format(field="  config.modle = 3", **{"imports": ""}), None,
    ["modle is not a config group", 'Did you mean "model"'],
  ),
  "typo_in_the_users_module": (
    "import own_module\nfrom configs import default\nget_config = default.get_config\n",
    _OWN_MODULE, ["own_module.py, line 11", "AttributeError", "has no attribute 'parm'"],
  ),
  "library_raising_for_the_users_module": (  # the user's line, not numpy's
    "import own_module\nfrom configs import default\nget_config = default.get_config\n",
    "import numpy as np\n\nx = np.flaot32(1)\n",
    ["own_module.py, line 3 (x = np.flaot32(1))", "has no attribute 'flaot32'"],
  ),
  "encoding_defined_in_the_config_file": (
    _INLINE_ENCODING + "from configs import default\n\n\ndef get_config():\n"
    "  config = default.get_config()\n  config.posenc.kind = 'inline'\n  return config\n",
    None, ["posenc.kind 'inline' defined in", "could not import again"],
  ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_MISTAKES))
def test_a_mistake_in_the_users_project_is_one_line_saying_where(tmp_path, case):
  config, module, expected = _MISTAKES[case]
  project = _project(tmp_path, **WITH_IMPORT)
  (project / "gauss_config.py").write_text(config)
  if module is not None:
    (project / "own_module.py").write_text(module)
  result = _train(project, tmp_path / "run", **{"train.num_train_steps": 1})
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  for text in expected:
    assert text in errors[0], errors[0]
  assert not (tmp_path / "run" / "config.json").exists()
