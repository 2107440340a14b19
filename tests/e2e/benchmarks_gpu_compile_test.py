"""benchmarks/tpu_compile.py for NVIDIA GPUs: the train step compiles for H100s on this machine
(JAX's CUDA plugin, no GPU), and cuDNN runs the kernels it is meant to (custom_calls.py)."""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import custom_calls, gpu_targets
from roformer.testing import REPO

needs_cuda_plugin = pytest.mark.skipif(
  importlib.util.find_spec("jax_cuda13_plugin") is None
  or importlib.util.find_spec("nvidia.cudnn") is None,
  reason=f"the JAX CUDA plugin and cuDNN are not installed ({gpu_targets.INSTALL})",
)


def _compile(*overrides):
  args = [
    sys.executable, "-m", "benchmarks.tpu_compile",
    f"--config={REPO / 'configs' / 'tpu_compile_tiny.py'}", "--topology=h100:8",
    "--config.model.dtype=bfloat16", "--custom_calls", *overrides,
  ]  # fmt: skip
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # tpu_compile's default
  return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _calls(stdout: str) -> set[tuple[str, str, int]]:
  """(target, mask, operands) of the rows of tpu_compile's custom-call table."""
  rows = stdout.split("custom calls")[1].splitlines()[3:]
  cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows if row.startswith("| ")]
  return {(t, mask, int(operands)) for t, mask, operands, _ in cells if operands.isdigit()}


@pytest.mark.slow
@needs_cuda_plugin
@pytest.mark.parametrize(
  "overrides, forward",
  [
    # Unpacked causal attention: cuDNN's causal kernel on q, k, v, no mask operand.
    ((), ("__cudnn$fmhaSoftmax", "CAUSAL", 3)),
    # Packed documents: their mask reaches cuDNN as a fourth operand.
    (("--config.data.pack=true",), ("__cudnn$fmhaScaleBiasSoftmax", "CAUSAL", 4)),
    # ALiBi: a bias, and still the causal kernel.
    (("--config.posenc.kind=alibi",), ("__cudnn$fmhaScaleBiasSoftmax", "CAUSAL", 4)),
  ],
)
def test_step_compiles_for_eight_h100s_with_fsdp_and_calls_cudnn_as_meant(overrides, forward):
  # data=2 x fsdp=4: cuDNN's call is split over the mesh as the other opaque kernels are; left to
  # its own partitioning rule it refused this mesh (q, k and v sharded differently).
  result = _compile(*overrides)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "8 x NVIDIA H100 80GB HBM3 on 1 hosts" in result.stdout
  assert "data=2, fsdp=4, tensor=1" in result.stdout
  assert "| fits                       | yes |" in result.stdout
  calls = _calls(result.stdout)
  assert forward in calls, calls
  assert {target for target, _, _ in calls if target.startswith("__cudnn")} == {
    forward[0],
    forward[0] + "Backward",
  }, calls


def test_custom_calls_are_counted_by_target_mask_and_operands():
  hlo = "\n".join([
    '  %a = (bf16[2,4,8,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
    'custom_call_target="__cudnn$fmhaSoftmax", backend_config={"mask_type":"CAUSAL"}',
    '  %b = (bf16[2,4,8,16]{3,2,1,0}, u8[0]{0}) custom-call(%q.1, %k.1, %v.1), '
    'custom_call_target="__cudnn$fmhaSoftmax", backend_config={"mask_type": "CAUSAL"}',
    '  %c = bf16[2]{0} custom-call(%q, %k, %v, %o, %do, /*index=5*/%bias), '
    'custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward", backend_config={}',
    '  %d = u32[] custom-call(), custom_call_target="Sharding"',
    "  %e = bf16[2]{0} add(%x, %y)",
  ])  # fmt: skip
  assert custom_calls.calls(hlo) == {
    ("__cudnn$fmhaSoftmax", "CAUSAL", 3): 2,
    ("__cudnn$fmhaScaleBiasSoftmaxBackward", "", 6): 1,
    ("Sharding", "", 0): 1,
  }


def test_gpu_names_parse_into_hosts_and_gpus_and_others_do_not():
  assert gpu_targets.parse("h100") == ("h100", 1, 1)
  assert gpu_targets.parse("H200:8") == ("h200", 1, 8)
  assert gpu_targets.parse("a100:2x4") == ("a100", 2, 4)
  assert gpu_targets.parse("v4:2x2x4") is None  # a TPU slice
  assert gpu_targets.parse("h100:8x") is None
  config = gpu_targets.target_config("h100", cudnn=(9, 28), cuda=(13, 0))
  assert "core_count: 132" in config and "major: 9 minor: 0" in config
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in config
  assert gpu_targets.memory_bytes("NVIDIA H100 80GB HBM3") == 81_559 << 20
  assert gpu_targets.memory_bytes("TPU v4") == 0


def test_without_the_cuda_plugin_the_error_says_what_to_install(monkeypatch):
  monkeypatch.setattr(jax._src.lib, "cuda_versions", None)
  with pytest.raises(RuntimeError, match="jax-cuda13-plugin==0.10.2"):
    gpu_targets.devices("h100")
  with pytest.raises(ValueError, match="names no GPU"):
    gpu_targets.devices("v4:2x2x4")
