"""Tests of generate.py and roformer.generate.generate_text on a workdir with a checkpoint."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from configs import default
from roformer import config as config_lib
from roformer import generate as gen
from roformer import runs, testing
from roformer.data.tokenizer import ByteTokenizer
from roformer.infra import checkpoint
from roformer.nn.model import make_model
from roformer.posenc.config import ContextExtension


def _make_run(workdir: Path, model_kind: str):
  """config.json and a step-3 checkpoint of a random tiny model (bytes tokenizer); the model."""
  config = default.get_config()
  config.model.kind = model_kind
  config.model.num_layers = 1
  config.model.emb_dim = 16
  config.model.num_heads = 2
  config.model.mlp_dim = 32
  config.data.seq_len = 16
  run_config = config_lib.run_config_from_dict(config, vocab_size=ByteTokenizer().vocab_size)
  config_lib.write_config_json(workdir, run_config)
  model = make_model(run_config.model, rngs=nnx.Rngs(0))
  manager = checkpoint.make_manager(workdir)
  checkpoint.save(manager, 3, nnx.state(model), {"unused": np.zeros(1)}, {"step": 3})
  manager.wait_until_finished()
  manager.close()
  return model


def _run_cli(*args):
  return testing.run_script("generate.py", *args)


@pytest.mark.slow
def test_cli_prints_the_greedy_continuation_of_the_checkpoint(tmp_path):
  model = _make_run(tmp_path / "run", "decoder")
  tok = ByteTokenizer()
  ids = tok.encode("def f(")
  want = gen.generate(model, np.asarray([ids], np.int32), max_new_tokens=5)
  proc = _run_cli(f"--workdir={tmp_path / 'run'}", "--prompt=def f(", "--max_new_tokens=5")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.rstrip("\n") == tok.decode(np.asarray(want[0, len(ids) :]).tolist())


def test_cli_refuses_an_encoder_run_with_one_clear_line(tmp_path):
  _make_run(tmp_path / "mlm", "encoder")
  proc = _run_cli(f"--workdir={tmp_path / 'mlm'}", "--prompt=x")
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert "generate.py: error:" in proc.stderr and "model.kind='decoder'" in proc.stderr


def test_generate_text_with_attention_sinks_equals_generate_of_the_extended_model(tmp_path):
  model = _make_run(tmp_path / "run", "decoder")
  ext = ContextExtension("sinks", sinks=2, window=4)
  prompt = "def f(x): return"
  ids = ByteTokenizer().encode(prompt)
  posenc = dataclasses.replace(model.cfg.posenc, extension=ext)
  extended = runs.with_config(model, dataclasses.replace(model.cfg, posenc=posenc))
  want = gen.generate(extended, np.asarray([ids], np.int32), max_new_tokens=8)
  got = gen.generate_text(tmp_path / "run", prompt, max_new_tokens=8, extension=ext)
  assert got == ByteTokenizer().decode(np.asarray(want[0, len(ids) :]).tolist())
  # The cache of every layer holds the 2 sinks and the 4 recent keys, not the 24 positions.
  assert {c.k_BCGK.shape[1] for c in extended.init_caches(1, len(ids) + 8)} == {6}
  refused = _run_cli(
    f"--workdir={tmp_path / 'run'}", "--prompt=x", "--extend=rerope", "--extend_window=2",
    "--extend_group=2",
  )  # fmt: skip
  assert refused.returncode == 1
  assert "--extend_group is not read by --extend=rerope" in refused.stderr
