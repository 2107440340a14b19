"""benchmarks.throughput: the smoke run compiles and times the real train step."""

import json
import os
import platform
import subprocess
import sys

import pytest

from benchmarks import alternate, bench_step
from roformer.testing import REPO


def _run_benchmark(name: str, *args: str) -> subprocess.CompletedProcess:
  """Runs `python -m benchmarks.<name>` on the CPU; fails the test with its stderr if it fails."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc


def test_throughput_smoke_reports_speed_and_flops(tmp_path):
  out = tmp_path / "throughput.json"
  proc = _run_benchmark("throughput", "--smoke", f"--json={out}")
  result = json.loads(out.read_text())
  assert result["kind"] == "encoder"
  assert result["tokens_per_sec"] > 0 and result["compile_seconds"] > 0
  # 2 layers x (q, k, v, out: 4 x 32 x 32; MLP 2 x 32 x 64) + head (128 x 32 + 32 x 32), times 6,
  # plus 12 x 2 layers x 32 positions x 2 heads x 16 dims of attention.
  assert result["nominal_flops_per_token"] == 6 * (2 * 8192 + 5120) + 12 * 2 * 32 * 2 * 16
  assert result["executed_flops_per_token"] > 0
  assert result["mfu_executed"] > 0 and result["peak_flops_per_sec"] > 0
  assert "ours / HF" not in proc.stdout  # only with --compare_hf
  # A CPU has no datasheet peak: no chip MFU (a TPU or GPU of CHIP_PEAK_BF16 gets one).
  assert result["mfu_chip"] is None and "chip peak" not in proc.stdout


def test_matmul_table_covers_both_dtypes(tmp_path):
  out = tmp_path / "matmul.json"
  proc = _run_benchmark("matmul", "--sizes=64", "--repeats=2", f"--json={out}")
  rows = json.loads(out.read_text())["rows"]
  assert [(r["size"], r["dtype"]) for r in rows] == [(64, "float32"), (64, "bfloat16")]
  assert all(r["jax_gflops"] > 0 for r in rows)
  assert "| 64 | bfloat16 |" in proc.stdout


def test_attention_products_table_times_every_form():
  args = ("--rows=16", "--keys=16,32", "--head_dim=8", "--repeats=2")
  proc = _run_benchmark("attention_products", *args)
  lines = proc.stdout.splitlines()
  rows = [line for line in lines if line.startswith("| ") and "GFLOP" not in line]
  forms = [row.split(" | ")[1] for row in rows]
  assert forms == ["NT", "NN", "NN", "TN", "NN"]
  for row in rows:  # a positive rate for each key count
    cells = row.strip("| ").split(" | ")[2:]
    assert len(cells) == 2 and all(float(c.replace(",", "")) > 0 for c in cells)


def test_ab_step_traces_b_under_the_variant_and_reports_the_ratio(tmp_path):
  # B's attention sleeps 50 ms per step (a host callback traced into B's step only): B must come
  # out slower than A, and the patch must be undone after B is traced.
  undone, out = tmp_path / "undone", tmp_path / "ab.json"
  variant = tmp_path / "variant.py"
  variant.write_text(
    "import pathlib, time\n"
    "import jax\n"
    "from roformer.nn.attention import softmax\n"
    "def apply():\n"
    "  old = softmax.Attention.qkv\n"
    "  def slow(self, x):\n"
    "    jax.debug.callback(lambda: time.sleep(0.05))\n"
    "    return old(self, x)\n"
    "  softmax.Attention.qkv = slow\n"
    "  def undo():\n"
    "    softmax.Attention.qkv = old\n"
    f"    pathlib.Path({str(undone)!r}).write_text('undone')\n"
    "  return undo\n"
  )
  proc = _run_benchmark("ab_step", "--smoke", f"--variant={variant}", f"--json={out}")
  assert undone.read_text() == "undone"
  result = json.loads(out.read_text())
  assert result["pairs"] == 4
  assert result["tokens_per_sec_b"] < result["tokens_per_sec_a"]
  low, high = result["speed_ratio_quartiles"]
  assert 0 < low <= result["speed_ratio_median"] <= high < 1  # B / A speed: B is the slow one
  assert "B / A speed, median of 4 pairs" in proc.stdout


@pytest.mark.parametrize(
  "text, message",
  [
    ("x = 1\n", "defines neither apply() nor compiler_options"),
    ("compiler_options = {'xla_no_such_option': True}\n", "xla_no_such_option"),
  ],
)
def test_ab_step_refuses_a_variant_without_hooks_and_passes_compiler_options(
  tmp_path, text, message
):
  variant = tmp_path / "variant.py"
  variant.write_text(text)
  cmd = [sys.executable, "-m", "benchmarks.ab_step", "--smoke", f"--variant={variant}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and message in proc.stderr


def test_a_child_process_serves_our_step_in_turn_and_reports_it():
  # What --compare_hf runs each side in: the child builds, warms up, then times on request.
  cmd = [sys.executable, "-m", "benchmarks.throughput", "--smoke", "--serve=ours",
         "--keep_freed_memory=true"]  # fmt: skip
  env = dict(bench_step.child_env(), JAX_PLATFORMS="cpu")  # finds the packages from any cwd
  child = alternate.ChildProcess(cmd, "ours", env=env)
  try:
    (first, second), *_ = alternate.alternate([child], steps=2, repeats=2)
    info = child.info()
  finally:
    child.close()
  assert child.proc.returncode == 0  # closing its stdin ends it cleanly
  assert first[0] > 0 and second[0] > 0
  assert info["compile_seconds"] > 0 and info["flops_per_step"] > 0
  assert info["peak_flops_per_sec"] > 0 and info["devices"].endswith("(cpu)")
  # The child's own process, under the malloc setting it was given (glibc's malloc only).
  glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
  assert info["pid"] == child.proc.pid != os.getpid() and info["keeps_freed_memory"] == glibc


def test_a_child_process_that_dies_is_reported_with_its_status():
  child = alternate.ChildProcess([sys.executable, "-c", "import sys; sys.exit(3)"], "hf")
  try:
    with pytest.raises(alternate.ChildError, match="hf process exited with status 3"):
      alternate.alternate([child], steps=1, repeats=1)
  finally:
    child.close()


def test_a_reply_after_output_without_a_newline_is_still_read():
  code = (
    "import sys; sys.stdout.write('progress 50%'); "
    f"sys.stdout.write({alternate.REPLY!r} + '{{\"ready\": true}}\\n'); sys.stdout.flush(); "
    "import select; select.select([sys.stdin], [], [], 30)"  # at most 30 s: never a hang
  )
  child = alternate.ChildProcess([sys.executable, "-c", code], "ours")
  try:
    child.wait_ready()  # ChildError after 30 s if the reply had to start its line
  finally:
    child.close()
  assert child._ready == {"ready": True} and child.proc.returncode == 0
