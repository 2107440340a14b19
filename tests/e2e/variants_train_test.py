"""Each attention variant trains through train.py by config alone and eval.py scores it at 4L."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from roformer.testing import REPO

SEQ_LEN = 16

VARIANTS = {
  "mla": {"model.attention": "mla", "model.kv_lora_rank": 8, "model.qk_rope_head_dim": 4,
          "model.q_lora_rank": 8, "posenc.scaling.kind": "yarn", "posenc.scaling.factor": 2.0},
  "linear": {"model.attention": "linear", "model.attention_block": 8},
  "linear_favor_encoder": {"model.kind": "encoder", "model.attention": "linear",
                           "model.linear_feature_map": "favor"},
  "window_pattern": {"model.attention_window_pattern": "4,0", "posenc.kind": "alibi"},
  "encoder_global": {"model.kind": "encoder", "model.attention_window": 4,
                     "model.global_tokens": 2, "posenc.kind": "t5"},
  # The presets, at this length: chunks and windows of 4, the temperature's floor at 4.
  "irope": {"config": "configs/irope.py", "model.num_layers": 4,
            "model.attention_window_pattern": "4,4,4,0", "posenc.query_scale_floor": 4.0},
  "rnope_swa": {"config": "configs/rnope_swa.py", "model.num_layers": 4,
                "model.attention_window_pattern": "4,4,4,0", "model.attention_impl": "chunked",
                "model.attention_block": 8},
  "qk_rmsnorm_ssmax": {"model.qk_norm": "rmsnorm", "posenc.query_scale": "ssmax"},
  "logn_gemma_bases": {"posenc.query_scale": "logn",
                       "posenc.max_wavelength_pattern": "10000,1000000"},
  "resonance_yarn": {"posenc.rope_resonance": True, "posenc.scaling.kind": "yarn",
                     "posenc.scaling.factor": 2.0},
  "sinks_chunked_window": {"model.attention_sinks": True, "model.attention_impl": "chunked",
                           "model.attention_block": 8, "model.attention_window_pattern": "4,0"},
  "fox": {"config": "configs/fox.py", "model.attention_impl": "chunked",
          "model.attention_block": 8},
}  # fmt: skip


def _write_text(path: Path, seed: int, lines: int):
  rng = np.random.default_rng(seed)
  words = ["def", "return", "self", "import", "for", "in", "if", "x", "value", "print", "(", ")"]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(lines)) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_and_evaluates_at_four_times_the_training_length(tmp_path, name):
  _write_text(tmp_path / "text" / "train.txt", 0, lines=100)
  _write_text(tmp_path / "text" / "valid.txt", 1, lines=60)
  workdir = tmp_path / name
  overrides = {
    "model.num_layers": 2, "model.emb_dim": 32, "model.num_heads": 2, "model.mlp_dim": 64,
    "data.source": "files", "data.files": tmp_path / "text" / "train.txt",
    "data.validation_files": tmp_path / "text" / "valid.txt", "data.cache_dir": tmp_path / "c",
    "data.seq_len": SEQ_LEN, "train.global_batch_size": 4, "train.num_train_steps": 6,
    "train.log_every_steps": 3, "train.eval_every_steps": 6, "train.eval_max_tokens": 128,
    "train.checkpoint_every_steps": 6, "optim.warmup_steps": 1, **VARIANTS[name],
  }  # fmt: skip
  config = overrides.pop("config", "configs/default.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))

  def run(*args):
    proc = subprocess.run(
      [sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO,
      timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

  run(REPO / "train.py", f"--config={config}", f"--workdir={workdir}",
      *[f"--config.{k}={v}" for k, v in overrides.items()])  # fmt: skip
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert np.isfinite([x["train_loss"] for x in lines if "train_loss" in x]).all()
  run(REPO / "eval.py", f"--workdir={workdir}", f"--lengths={4 * SEQ_LEN}",
      "--protocol=nonoverlapping", "--max_tokens=256", "--out=at_4x")  # fmt: skip
  (record,) = json.loads((workdir / "eval" / "at_4x.json").read_text())["records"]
  assert record["length"] == 4 * SEQ_LEN and np.isfinite(record["loss"]), record
