"""benchmarks/gpu_check.py --smoke: every part runs on a CPU with tiny shapes (or is skipped, one
line, for a missing package), the table is printed and written, and its own check passes."""

import importlib.util
import json
import os
import subprocess
import sys

from roformer.testing import REPO

# The parts that need nothing beyond requirements.txt: these must run, not be skipped.
CORE_PARTS = ("throughput", "long_context", "first_step", "cudnn", "quickstart", "fallback")


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
  # The long sequence at both sequence blocks of the position-wise layers.
  assert {"ours 1 x long tokens/s", "ours 1 x long, seq block 64 tokens/s"} <= metrics
  # Each XLA kernel the fallback part compares, a row each.
  assert {"fallback chunked, block 16 tokens/s", "fallback dense, block 16 tokens/s",
          "fallback dense unsplit, block 16 tokens/s"} <= metrics  # fmt: skip
  for part in parts.values():  # each row printed as it came
    for row in part["rows"]:
      assert f"| {row['metric']}" in done.stdout, row["metric"]


def _run_part(part_script: str, limit: float) -> list:
  """gpu_check._run_part's (status, rows) for a part whose process runs `part_script`, called in
  a fresh interpreter (gpu_check defines absl flags that other benchmarks define too)."""
  driver = (
    "import json, sys\n"
    "from benchmarks import gpu_check\n"
    "gpu_check._part_cmd = lambda name: [sys.executable, '-c', sys.argv[1]]\n"
    "print(json.dumps(gpu_check._run_part('part', limit=float(sys.argv[2]), shared_cache='')))\n"
  )
  done = subprocess.run(
    [sys.executable, "-c", driver, part_script, str(limit)],
    cwd=REPO, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.splitlines()[-1])


def test_a_part_stopped_at_its_limit_keeps_the_rows_it_printed():
  # A part that prints one row, then hangs past its limit.
  row = {"metric": "done", "value": 1.0, "note": ""}
  script = f"import time; print('@@row ' + {json.dumps(row)!r}, flush=True); time.sleep(60)"
  assert _run_part(script, limit=5) == ["timed out after 5 s", [row]]


def test_a_failed_part_says_its_last_error_line():
  assert _run_part("import sys; sys.exit('no GPU here')", limit=30) == ["failed: no GPU here", []]
