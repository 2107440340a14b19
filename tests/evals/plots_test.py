"""Tests of evals/plots.py that need no figure: it imports no JAX, and it reads the training length
from a run's config.json."""

import json
import subprocess
import sys

from roformer.evals import plots


def test_plots_import_no_jax():
  # eval.py --compare draws existing results with these modules alone, without starting JAX.
  code = (
    "import sys\n"
    "from roformer.evals import plots, task_plots\n"
    "print(','.join(m for m in ('jax', 'flax') if m in sys.modules))"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == ""


def test_training_length_reads_config_json_and_is_zero_without_it(tmp_path):
  assert plots.training_length(tmp_path) == 0
  (tmp_path / "config.json").write_text(json.dumps({"data": {"seq_len": 128}}))
  assert plots.training_length(tmp_path) == 128
