"""Shared pieces of the training tests: a tiny config over tests/fixtures/tiny_corpus, train.py
subprocesses (simulated CPU devices, one JAX compilation cache per test session) and metrics."""

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "fixtures" / "tiny_corpus"
# Identical programs compile once per session across the subprocesses.
_CACHE_DIR = tempfile.mkdtemp(prefix="roformer_test_jax_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)

# A 2-layer, 32-wide decoder on 32-token windows of the tiny corpus, with dropout (so the tests
# also cover the dropout keys), logging every step.
TINY = {
  "data.source": "files",
  "data.files": str(CORPUS / "train" / "*.txt"),
  "data.validation_files": str(CORPUS / "validation" / "*.txt"),
  "data.seq_len": 32,
  "model.num_layers": 2,
  "model.emb_dim": 32,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
  "model.dropout_rate": 0.1,
  "model.attention_impl": "dense",
  "model.attention_block": 32,
  "train.global_batch_size": 8,
  "train.num_train_steps": 40,
  "train.log_every_steps": 1,
  "train.eval_every_steps": 20,
  "train.eval_max_tokens": 256,
  "train.checkpoint_every_steps": 20,
  "optim.warmup_steps": 5,
  "optim.learning_rate": 3e-3,
}


def tiny_config(overrides: dict | None = None, config_file: str = "configs/default.py"):
  """The ConfigDict of `config_file` with TINY and `overrides` (dotted names) applied."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("config_module", REPO / config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for name, value in {**TINY, **(overrides or {})}.items():
    group, _, field = name.rpartition(".")
    node = config
    for part in group.split("."):
      node = node[part]
    node[field] = value
  return config


def flag_args(overrides: dict) -> list[str]:
  return [f"--config.{name}={value}" for name, value in overrides.items()]


def subprocess_env(devices: int = 1, **extra: str) -> dict:
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_COMPILATION_CACHE_DIR=_CACHE_DIR,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
    PYTHONPATH=str(REPO),
  )
  env.update(extra)
  return env


def train_command(workdir, overrides=None, *, config="configs/default.py", tiny=True, args=()):
  settings = {**(TINY if tiny else {}), **(overrides or {})}
  return [
    sys.executable,
    str(REPO / "train.py"),
    f"--config={REPO / config}",
    f"--workdir={workdir}",
    *flag_args(settings),
    *args,
  ]


def run_train(workdir, overrides=None, *, devices=1, env=None, timeout=600, **kwargs):
  """Runs train.py to the end; returns the CompletedProcess (stdout and stderr as text)."""
  return subprocess.run(
    train_command(workdir, overrides, **kwargs),
    env=subprocess_env(devices, **(env or {})),
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def start_train(workdir, overrides=None, *, devices=1, env=None, log_path=None, **kwargs):
  """Starts train.py in the background; stdout and stderr go to `log_path`."""
  log = open(log_path or Path(workdir).with_suffix(".log"), "w")
  return subprocess.Popen(
    train_command(workdir, overrides, **kwargs),
    env=subprocess_env(devices, **(env or {})),
    cwd=REPO,
    stdout=log,
    stderr=subprocess.STDOUT,
    text=True,
  )


def read_metrics(workdir) -> tuple[dict, dict]:
  """(train records by step, eval records by step) of DIR/metrics.jsonl; the last record wins."""
  train, evals = {}, {}
  path = Path(workdir) / "metrics.jsonl"
  for line in path.read_text().splitlines():
    record = json.loads(line)
    (evals if "eval_loss" in record else train)[record["step"]] = record
  return train, evals


def checkpoint_steps(workdir) -> list[int]:
  """Steps of finished checkpoints (Orbax renames a checkpoint's tmp dir when it is complete)."""
  root = Path(workdir) / "checkpoints"
  if not root.exists():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def assert_close(a: float, b: float, rel: float, what: str) -> None:
  assert abs(a - b) <= rel * max(abs(a), abs(b)), f"{what}: {a} != {b} (rel tol {rel})"
