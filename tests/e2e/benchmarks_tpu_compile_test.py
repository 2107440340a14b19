"""benchmarks/tpu_compile.py: the train step compiles for a multi-host TPU slice on this machine."""

import importlib.util
import os
import subprocess
import sys

import pytest

from roformer.testing import REPO

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason='libtpu is not installed (pip install -c requirements.txt "jax[tpu]==0.10.2")',
)


def _compile(*overrides):
  args = [
    sys.executable,
    "-m",
    "benchmarks.tpu_compile",
    f"--config={REPO / 'configs' / 'tpu_compile_tiny.py'}",
    "--topology=v4:2x2x2",
    *overrides,
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@needs_libtpu
def test_tiny_config_compiles_for_two_hosts_and_fits():
  result = _compile()
  assert result.returncode == 0, result.stderr[-3000:]
  assert "8 x TPU v4 on 2 hosts" in result.stdout
  assert "data=2, fsdp=4, tensor=1" in result.stdout
  assert "| fits                       | yes |" in result.stdout


@pytest.mark.slow
@needs_libtpu
def test_model_too_big_for_hbm_exits_non_zero():
  # 2 layers of 16384 x 262144 MLPs: about 17B parameters, ~200 GiB with Adam over 4 fsdp shards.
  result = _compile("--config.model.emb_dim=16384", "--config.model.mlp_dim=262144")
  assert result.returncode == 2, result.stderr[-3000:]
  assert "does not fit the device memory" in result.stderr


@pytest.mark.slow
@needs_libtpu
def test_memory_report_lists_the_largest_buffers_of_each_kernel():
  result = _compile("--kernels=chunked,splash", "--memory_report=3")
  assert result.returncode == 0, result.stderr[-3000:]
  for kernel in ("chunked", "splash"):
    table = result.stdout.split(f"{kernel}: largest buffers by shape, per device")[1]
    rows = [line for line in table.splitlines()[3:] if line.startswith("| ")][:3]
    assert len(rows) == 3, table  # shape | allocations | MiB
    assert all(float(row.split("|")[3]) > 0 for row in rows), rows
