"""benchmarks/gpu_check.py --smoke: every part runs on a CPU with tiny shapes (or is skipped, one
line, for a missing package), the table is printed and written, and its own check passes."""

import importlib.util
import json
import os
import subprocess
import sys

from roformer.testing import REPO

# The parts that need nothing beyond requirements.txt: these must run, not be skipped.
CORE_PARTS = ("throughput", "long_context", "first_step", "cudnn", "quickstart")


def test_gpu_check_smoke_runs_every_part_and_checks_its_table(tmp_path):
  out = tmp_path / "gpu_check.json"
  # Where torch is installed its parts would run (a minute of torch.compile): the core parts only.
  parts = [f"--parts={','.join(CORE_PARTS)}"] if importlib.util.find_spec("torch") else []
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", f"--json={out}", *parts],
    cwd=REPO, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert done.returncode == 0, done.stdout + done.stderr
  parts = json.loads(out.read_text())["parts"]
  for name in CORE_PARTS:
    assert parts[name]["status"] == "ok", (name, parts[name]["status"])
    assert parts[name]["rows"], name
  for name, part in parts.items():  # the Hugging Face parts need torch and transformers
    assert part["status"] == "ok" or part["status"].startswith("skipped: needs"), name
  metrics = {row["metric"] for part in parts.values() for row in part["rows"]}
  assert {"first step, cold s", "first step, warm s", "quickstart eval_loss"} <= metrics
  assert any(m.startswith("cudnn rope:") for m in metrics)  # the kernel auto gives RoPE on a GPU
  for part in parts.values():  # each row printed as it came
    for row in part["rows"]:
      assert f"| {row['metric']}" in done.stdout, row["metric"]
