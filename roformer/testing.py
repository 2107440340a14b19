"""Builders shared by the tests (and handy in a notebook): encodings as a model builds them, tiny
models with random parameters, and train.py runs on a tiny corpus in subprocesses.

The paths (REPO, FIXTURES, CORPUS) and the train.py helpers assume a source checkout, where this
package sits beside tests/ and train.py (the editable install).
"""

import atexit
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer import posenc
from roformer.nn.config import ModelConfig
from roformer.nn.model import make_model
from roformer.posenc.config import PosEncConfig

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CORPUS = FIXTURES / "tiny_corpus"

# ---- Positional encodings ----


def build_posenc(
  kind="rope", *, num_heads=4, head_dim=16, emb_dim=64, causal=True, num_kv_heads=0, **fields
):
  """Validates and builds an encoding outside any mesh, as a model does (its ModelConfig checks
  the posenc when built); parameters keep their logical axes as metadata. `num_kv_heads`
  (0 = num_heads) is the number of key heads."""
  cfg = PosEncConfig(kind=kind, **fields)
  posenc.validate_posenc(cfg, causal=causal, head_dim=head_dim)
  with nnx.use_eager_sharding(False):
    return posenc.make_posenc(
      cfg, num_heads=num_heads, head_dim=head_dim, emb_dim=emb_dim, causal=causal,
      num_kv_heads=num_kv_heads, rngs=nnx.Rngs(0),
    )  # fmt: skip


# ---- Tiny models with random values in every parameter (the attention-variant tests) ----

TINY_VOCAB = 32
TINY_MODEL = ModelConfig(
  kind="decoder",
  vocab_size=TINY_VOCAB,
  num_layers=2,
  emb_dim=16,
  num_heads=4,
  num_kv_heads=2,
  mlp_dim=32,
)


def tiny_model_config(posenc="rope", posenc_fields=None, **fields):
  """TINY_MODEL with the encoding `posenc` (its fields as a dict) and model fields overridden."""
  pe = PosEncConfig(kind=posenc, max_len=64, **(posenc_fields or {}))
  return dataclasses.replace(TINY_MODEL, posenc=pe, **fields)


def attention_layer(*, seed: int = 0, **fields):
  """The softmax attention of layer 0 of a decoder whose ModelConfig has `fields` (a layer is
  built from its model config and LayerSpec, as a model builds it)."""
  from roformer.nn.attention.softmax import Attention

  cfg = ModelConfig(kind="decoder", **fields)
  return Attention(cfg, cfg.layers[0], rngs=nnx.Rngs(seed))


def random_model(cfg, seed=0):
  """make_model's structure with random values in every parameter (norms and biases included)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    name = path[-2].key
    noise = rng.standard_normal(x.shape).astype(np.float32)
    if name == "scale":
      value = 1.0 + 0.1 * noise
    elif name in ("bias", "head_bias"):
      value = 0.1 * noise
    elif name == "kernel":  # fan-in scaling, roughly
      value = noise / np.sqrt(np.prod(x.shape) / x.shape[-1] if x.ndim > 1 else 1.0)
    else:
      value = 0.5 * noise
    return jnp.asarray(value, x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def random_tokens(batch, length, seed=1):
  """[batch, length] token ids below TINY_VOCAB."""
  return jnp.asarray(
    np.random.default_rng(seed).integers(0, TINY_VOCAB, (batch, length)), jnp.int32
  )


def arange_positions(batch, length, start=0):
  """[batch, length] positions start, start + 1, ... in every row."""
  return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


@jax.jit
def forward(model, tokens_BL, positions_BL):
  return model(tokens_BL, positions_BL)


# Prompt and new tokens of `check_cached_generation`: the sequence (9) passes the original
# length (4) of the scalings the tests use.
PROMPT_LEN, NEW_TOKENS = 3, 6


def decoder_loss_and_grads(attention_impl, posenc="rope", **fields):
  """(next-token loss, parameter gradients) of a 2-layer, 32-wide, 4-head decoder (seed 0) on 2 x
  100 random tokens, its attention run by `attention_impl`: what the fused-kernel tests compare
  against the dense kernel's. `fields` are further ModelConfig fields."""
  cfg = ModelConfig(
    kind="decoder", vocab_size=64, num_layers=2, emb_dim=32, num_heads=4, mlp_dim=64,
    attention_impl=attention_impl, posenc=PosEncConfig(kind=posenc), **fields,
  )  # fmt: skip
  model = make_model(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 100)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(100), (2, 100))

  def loss(model):
    logits = model(tokens, positions)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1).mean()

  # One compiled program, as the train step is (op by op, each primitive compiles on its own).
  return nnx.jit(nnx.value_and_grad(loss))(model)


def assert_training_step_equals_dense(attention_impl, tol, posenc="rope", **fields):
  """`decoder_loss_and_grads` through `attention_impl` equals it through the dense kernel: the
  loss to 1e-6, every gradient to `tol` of its largest magnitude (at least 1)."""
  l_dense, g_dense = decoder_loss_and_grads("dense", posenc, **fields)
  l_impl, g_impl = decoder_loss_and_grads(attention_impl, posenc, **fields)
  assert abs(float(l_dense - l_impl)) < 1e-6
  for a, b in zip(jax.tree.leaves(g_impl), jax.tree.leaves(g_dense), strict=True):
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(jnp.abs(b).max())))


def greedy_by_full_forward(model, prompt_BP, n):
  """Greedy tokens and next-token logits from one full forward pass per step.

  Each pass sees the sequence so far padded to its final length P + n: a causal model's logits
  at t - 1 do not depend on the padding, and dynamic NTK runs at the generation's length, as
  `generate` does (see its module doc).
  """
  B, P = prompt_BP.shape
  seq_BT = jnp.concatenate([prompt_BP, jnp.zeros((B, n), jnp.int32)], 1)
  logits = []
  for t in range(P, P + n):
    last_BV = forward(model, seq_BT, arange_positions(B, P + n))[:, t - 1]
    logits.append(last_BV)
    seq_BT = seq_BT.at[:, t].set(jnp.argmax(last_BV, -1).astype(jnp.int32))
  return seq_BT, jnp.stack(logits, 1)


def check_cached_generation(cfg):
  """Greedy `generate` and cached logits of a random `cfg` model equal full forward passes."""
  from roformer import generate as gen

  model = random_model(cfg)
  prompt_BP = random_tokens(2, PROMPT_LEN)
  want_BT, want_logits = greedy_by_full_forward(model, prompt_BP, NEW_TOKENS)
  got_BT = gen.generate(model, prompt_BP, max_new_tokens=NEW_TOKENS)
  np.testing.assert_array_equal(got_BT, want_BT)
  got_logits = gen.cached_logits(model, want_BT, PROMPT_LEN)[:, :-1]
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)


# ---- train.py runs on the tiny corpus (simulated CPU devices, one compilation cache) ----

# A 2-layer, 32-wide decoder on 32-token windows of the tiny corpus, with dropout (so the tests
# also cover the dropout keys), logging every step.
TINY_TRAIN = {
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


@functools.cache
def _compilation_cache_dir() -> str:
  """One JAX compilation cache per process, made on first use and removed at exit: identical
  programs compile once across the train.py subprocesses of a test session."""
  path = tempfile.mkdtemp(prefix="roformer_test_jax_cache_")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def tiny_config(overrides: dict | None = None, config_file: str = "configs/default.py"):
  """The ConfigDict of `config_file` with TINY_TRAIN and `overrides` (dotted names) applied."""
  return config_file_with(config_file, {**TINY_TRAIN, **(overrides or {})})


def config_file_with(config_file: str, overrides: dict):
  """The ConfigDict of the repository's `config_file` with `overrides` (dotted names) applied,
  as train.py's `--config=FILE --config.NAME=VALUE` gives it."""
  spec = importlib.util.spec_from_file_location("config_module", REPO / config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return set_fields(module.get_config(), overrides)


def set_fields(config, overrides: dict):
  """`config` (a ConfigDict) with each dotted name of `overrides` set, nested groups too."""
  for name, value in overrides.items():
    group, _, field = name.rpartition(".")
    node = config
    for part in group.split("."):
      node = node[part]
    node[field] = value
  return config


def flag_args(overrides: dict) -> list[str]:
  return [f"--config.{name}={value}" for name, value in overrides.items()]


# The names of the flags that the entry points loaded by `load_script` defined.
_SCRIPT_FLAGS: set[str] = set()


def load_script(script: str):
  """The repository's entry point `script` ("train.py", "eval.py", "generate.py") as a fresh
  module of this process, for in-process tests of its flag checks and `main`.

  Its flags go on absl's global FlagValues. The scripts define flags of the same names
  (--workdir, --config), which absl refuses from two modules (and from two loads of one file):
  the flags of the scripts loaded before are removed first.
  """
  from absl import flags

  # A config flag's parse defines one flag per override (--config.model.num_layers): those too.
  for name in [n for n in flags.FLAGS if n.split(".")[0] in _SCRIPT_FLAGS]:
    delattr(flags.FLAGS, name)
  before = set(flags.FLAGS)
  module_spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_script", REPO / script)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  _SCRIPT_FLAGS.update(set(flags.FLAGS) - before)
  return module


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  """Runs the repository's `script` (e.g. "eval.py") on CPU with `args`; output captured."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  return subprocess.run(
    [sys.executable, str(REPO / script), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
  )


def subprocess_env(devices: int = 1, **extra: str) -> dict:
  """The environment of a test's subprocess: `devices` CPU devices, the parent's other XLA flags
  (a user's XLA_FLAGS), the parent's JAX compilation cache (scripts/test.sh sets one for the
  whole suite), else one per test session."""
  env = dict(os.environ)
  flags = [
    f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
  ]
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
    JAX_COMPILATION_CACHE_DIR=env.get("JAX_COMPILATION_CACHE_DIR") or _compilation_cache_dir(),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=env.get(
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5"
    ),
    PYTHONPATH=str(REPO),
  )
  env.update(extra)
  return env


def train_command(workdir, overrides=None, *, config="configs/default.py", tiny=True, args=()):
  settings = {**(TINY_TRAIN if tiny else {}), **(overrides or {})}
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
