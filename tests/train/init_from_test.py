"""Tests of roformer/train/init_from.py: starting from a Hugging Face RoFormer checkpoint, and
fine-tuning a Hugging Face decoder (configs/hf_decoder.py) from exactly its weights, or refusing a
run whose config does not match it."""

import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import default, hf_decoder
from roformer import config as config_lib
from roformer import data, testing
from roformer.errors import ConfigError
from roformer.infra import sharding
from roformer.nn.model import make_model
from roformer.train import init_from


@pytest.mark.slow
def test_init_from_hf_roformer_loads_its_parameters():
  from roformer import hf

  path = testing.FIXTURES / "hf_roformer_tiny"
  loaded = hf.load_hf_roformer(str(path))
  mesh = sharding.make_mesh(config_lib.MeshConfig())
  make = lambda: make_model(loaded.config, rngs=nnx.Rngs(1))  # noqa: E731
  _, abstract = sharding.abstract_state(make, mesh, config_lib.MeshConfig().rules)
  state = init_from.load_init_state(str(path), abstract)
  expected = jax.tree.leaves(nnx.state(loaded.model))
  assert len(expected) == len(jax.tree.leaves(state))
  for a, b in zip(jax.tree.leaves(state), expected, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- A Hugging Face decoder: configs/hf_decoder.py, a fine-tune from its weights ----

# A character-level tokenizer of the decoder fixtures' 96 ids (text outside " ".."z" is <unk>).
SPECIALS = ["<pad>", "</s>", "<mask>", "<s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 123)]
# A few steps on 32-token windows of the tiny corpus, no periodic evaluation or checkpoint.
FINE_TUNE = {
  "data.source": "files",
  "data.files": str(testing.CORPUS / "train" / "*.txt"),
  "data.validation_files": str(testing.CORPUS / "validation" / "*.txt"),
  "data.seq_len": 32,
  "train.global_batch_size": 4,
  "train.num_train_steps": 2,
  "train.log_every_steps": 1,
  "train.eval_max_tokens": 0,
  "train.checkpoint_every_steps": 0,
  "optim.warmup_steps": 0,
  "optim.learning_rate": 1e-3,
}


@pytest.fixture
def hf_dirs(tmp_path, monkeypatch):
  """The Llama and GPT-NeoX fixtures with a tokenizer.json; a private token cache."""
  from tokenizers import Tokenizer, models

  monkeypatch.setenv("ROFORMER_CACHE", str(tmp_path / "cache"))
  vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).to_str()
  dirs = {}
  for family in ("llama", "gpt_neox"):
    dirs[family] = tmp_path / family
    shutil.copytree(testing.FIXTURES / f"hf_{family}_tiny", dirs[family])
    (dirs[family] / "tokenizer.json").write_text(tokenizer)
  return dirs


def _config(hf_dir, overrides=None, *, from_checkpoint=True):
  """configs/hf_decoder.py:HF_DIR (or default.py with train.init_from=HF_DIR) with FINE_TUNE and
  `overrides` (dotted names) applied."""
  if from_checkpoint:
    config = hf_decoder.get_config(str(hf_dir))
  else:
    config = default.get_config()
    config.data.tokenizer = str(hf_dir / "tokenizer.json")
    config.train.init_from = str(hf_dir)
  return testing.set_fields(config, {**FINE_TUNE, **(overrides or {})})


def _first_batch_loss(model, workdir) -> float:
  """The mean next-token loss of `model` on the run's batch of step 0."""
  run_config = config_lib.load_run_config(workdir)
  corpus = data.load_corpus(run_config.data, workdir=str(workdir))
  batch = corpus.train_batches(
    run_config.data, model_kind="decoder", global_batch_size=4, seed=0, process_index=0,
    process_count=1,
  ).batch(0)  # fmt: skip
  logits = np.asarray(testing.forward(model, batch["inputs"], batch["positions"]), np.float64)
  logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  nll = -np.take_along_axis(np.asarray(logp), batch["targets"][..., None], axis=-1)[..., 0]
  return float((nll * batch["weights"]).sum() / batch["weights"].sum())


@pytest.mark.slow
def test_fine_tune_of_an_hf_decoder_starts_from_exactly_its_weights(hf_dirs, tmp_path):
  from roformer import hf
  from roformer.train import loop

  workdir = tmp_path / "run"
  loop.train_and_evaluate(_config(hf_dirs["llama"]), str(workdir))
  imported = hf.load_hf_decoder(hf_dirs["llama"])
  run_config = config_lib.load_run_config(workdir)
  assert run_config.model == imported.cfg  # the config file is the checkpoint's model
  train, _ = testing.read_metrics(workdir)
  want = _first_batch_loss(imported, workdir)
  # Step 1's loss is the first batch's under the initial weights: the imported ones.
  assert train[1]["train_loss"] == pytest.approx(want, rel=1e-5)
  # Negative control: the same model randomly initialised scores that batch far apart.
  random_model = make_model(run_config.model, rngs=nnx.Rngs(0))
  assert abs(_first_batch_loss(random_model, workdir) - want) > 0.1
  assert train[2]["train_loss"] != pytest.approx(train[1]["train_loss"], rel=1e-5)


@pytest.mark.slow
def test_yarn_fine_tune_of_an_hf_decoder_scales_its_rope_over_its_training_length(
  hf_dirs, tmp_path
):
  # The README's recipe: YaRN with factor 2 over max_position_embeddings (64), windows of 128.
  from roformer import hf, runs
  from roformer.train import loop

  path, workdir = hf_dirs["gpt_neox"], tmp_path / "run"
  overrides = {
    "posenc.scaling.kind": "yarn", "posenc.scaling.factor": 2.0, "data.seq_len": 128,
  }  # fmt: skip
  loop.train_and_evaluate(_config(path, overrides), str(workdir))
  scaling = config_lib.load_run_config(workdir).model.posenc.scaling
  assert (scaling.kind, scaling.factor, scaling.original_max_len) == ("yarn", 2.0, 64)
  imported = hf.load_hf_decoder(path)
  yarn = runs.with_config(
    imported, runs.eval_model_config(imported.cfg, seq_len=64, rope_scaling="yarn", rope_factor=2)
  )
  train, _ = testing.read_metrics(workdir)
  want = _first_batch_loss(yarn, workdir)
  assert train[1]["train_loss"] == pytest.approx(want, rel=1e-5)
  assert abs(_first_batch_loss(imported, workdir) - want) > 1e-3  # YaRN changed the numbers


@pytest.mark.parametrize(
  "overrides, from_checkpoint, message",
  [
    # A field that changes the parameters, and one that changes only the numbers.
    ({"model.num_heads": 2}, True, "this run's model.num_heads=2 differs from the Hugging Face "
     "checkpoint's model.num_heads=4"),
    ({"model.norm_eps": 1e-6}, True, "model.norm_eps=1e-06 differs"),
    # The checkpoint's llama3 scaling is kept unless the run sets another.
    ({"posenc.scaling.kind": "none"}, True, "posenc.scaling.kind='none' differs from the Hugging "
     "Face checkpoint's posenc.scaling.kind='llama3'"),
    # A config not made from the checkpoint: its first differing field.
    ({}, False, "this run's model.num_layers=6 differs from the Hugging Face checkpoint's "
     "model.num_layers=2"),
    ({"data.tokenizer": "bytes"}, True, "data.tokenizer=bytes gives text id 255, beyond the "
     "vocabulary of 96"),
  ],
)  # fmt: skip
def test_a_run_that_does_not_match_the_hf_decoder_is_refused_naming_the_field(
  hf_dirs, tmp_path, overrides, from_checkpoint, message
):
  from roformer.train import loop

  config = _config(hf_dirs["llama"], overrides, from_checkpoint=from_checkpoint)
  with pytest.raises(ConfigError, match=re.escape(message)) as refused:
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert "\n" not in str(refused.value)
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_cli_refuses_a_mismatch_and_a_config_file_without_its_directory_in_one_line(
  hf_dirs, tmp_path
):
  refused = testing.run_train(
    tmp_path / "run", {**FINE_TUNE, "model.num_layers": 3}, tiny=False,
    config=f"configs/hf_decoder.py:{hf_dirs['llama']}",
  )  # fmt: skip
  assert refused.returncode == 1 and "Traceback" not in refused.stderr
  last = refused.stderr.strip().splitlines()[-1]
  want = f"train.py: error: train.init_from={hf_dirs['llama']}: this run's model.num_layers=3 "
  assert last.startswith(want + "differs from the Hugging Face checkpoint's model.num_layers=2")
  config = f"--config={testing.REPO / 'configs' / 'hf_decoder.py'}"
  bare = subprocess.run(
    [sys.executable, str(testing.REPO / "train.py"), config, f"--workdir={tmp_path / 'other'}"],
    env=testing.subprocess_env(), cwd=testing.REPO, capture_output=True, text=True,
  )  # fmt: skip
  assert bare.returncode == 1 and not (tmp_path / "other").exists()
  assert bare.stderr.strip().splitlines() == [
    f"train.py: error: flag {config}: configs/hf_decoder.py reads a Hugging Face directory: "
    "--config=configs/hf_decoder.py:HF_DIR"
  ]
