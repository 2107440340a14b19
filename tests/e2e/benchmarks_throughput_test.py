"""benchmarks/throughput.py: the smoke run compiles and times the real train step."""

import json
import os
import subprocess
import sys

from roformer.testing import REPO


def _run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess:
  """Runs benchmarks/<script> on the CPU; fails the test with its stderr if it fails."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, str(REPO / "benchmarks" / script), *args]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc


def test_throughput_smoke_reports_speed_and_flops(tmp_path):
  out = tmp_path / "throughput.json"
  proc = _run_benchmark("throughput.py", "--smoke", f"--json={out}")
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
  proc = _run_benchmark("matmul.py", "--sizes=64", "--repeats=2", f"--json={out}")
  rows = json.loads(out.read_text())["rows"]
  assert [(r["size"], r["dtype"]) for r in rows] == [(64, "float32"), (64, "bfloat16")]
  assert all(r["jax_gflops"] > 0 for r in rows)
  assert "| 64 | bfloat16 |" in proc.stdout


def test_attention_products_table_times_every_form():
  args = ("--rows=16", "--keys=16,32", "--head_dim=8", "--repeats=2")
  proc = _run_benchmark("attention_products.py", *args)
  lines = proc.stdout.splitlines()
  rows = [line for line in lines if line.startswith("| ") and "GFLOP" not in line]
  forms = [row.split(" | ")[1] for row in rows]
  assert forms == ["NT", "NN", "NN", "TN", "NN"]
  for row in rows:  # a positive rate for each key count
    cells = row.strip("| ").split(" | ")[2:]
    assert len(cells) == 2 and all(float(c.replace(",", "")) > 0 for c in cells)


def test_ab_step_traces_b_under_the_variant_and_reports_the_ratio(tmp_path):
  marker, out = tmp_path / "applied", tmp_path / "ab.json"
  variant = tmp_path / "variant.py"
  variant.write_text(
    "import pathlib\n"
    "def apply():\n"
    f"  pathlib.Path({str(marker)!r}).write_text('patched')\n"
    "  return lambda: None\n"
  )
  proc = _run_benchmark("ab_step.py", "--smoke", f"--variant={variant}", f"--json={out}")
  assert marker.read_text() == "patched"  # B was traced under the patch
  result = json.loads(out.read_text())
  assert result["pairs"] == 4
  assert result["tokens_per_sec_a"] > 0 and result["tokens_per_sec_b"] > 0
  low, high = result["speed_ratio_quartiles"]
  assert 0 < low <= result["speed_ratio_median"] <= high
  assert "B / A speed, median of 4 pairs" in proc.stdout
  # A file with neither hook is refused with its name.
  empty = tmp_path / "empty.py"
  empty.write_text("x = 1\n")
  cmd = [sys.executable, str(REPO / "benchmarks" / "ab_step.py"), "--smoke", f"--variant={empty}"]
  proc = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)  # fmt: skip
  assert proc.returncode != 0 and "defines neither apply() nor compiler_options" in proc.stderr
