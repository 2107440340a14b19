"""Each attention variant trains by config alone (a config file and dotted overrides, as
train.py's flags give them) and evaluation scores it at 4L. In one process: train.py's and
eval.py's own flag handling is tested in tests/e2e/train_cli_test.py and eval_cli_test.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from roformer import testing
from roformer.evals import ppl_vs_length
from roformer.evals import spec as spec_lib
from roformer.train import loop as train_loop

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
    "data.source": "files", "data.files": str(tmp_path / "text" / "train.txt"),
    "data.validation_files": str(tmp_path / "text" / "valid.txt"),
    "data.cache_dir": str(tmp_path / "c"),
    "data.seq_len": SEQ_LEN, "train.global_batch_size": 4, "train.num_train_steps": 6,
    # No evaluation while training: the one at 4L below runs the same model code.
    "train.log_every_steps": 3, "train.eval_max_tokens": 0,
    "train.checkpoint_every_steps": 6, "optim.warmup_steps": 1, **VARIANTS[name],
  }  # fmt: skip
  config = testing.config_file_with(overrides.pop("config", "configs/default.py"), overrides)
  train_loop.train_and_evaluate(config, str(workdir))
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert np.isfinite([x["train_loss"] for x in lines if "train_loss" in x]).all()
  spec = spec_lib.spec_from_options(
    lengths=[4 * SEQ_LEN], protocol="nonoverlapping", max_tokens=256, out="at_4x"
  )
  ppl_vs_length.evaluate_workdir(workdir, spec, log=lambda line: None)
  (record,) = json.loads((workdir / "eval" / "at_4x.json").read_text())["records"]
  assert record["length"] == 4 * SEQ_LEN and np.isfinite(record["loss"]), record
