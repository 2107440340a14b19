"""Training throughput of the real train step, FLOPs per token, MFU, and Hugging Face side by side.

Times train_lib's train step, jitted with the same shardings and donation as train.py, on
synthetic batches shaped like the config's (encoder: BERT-masked positions at
data.mlm_probability; decoder: every position scored). Prints one table and optionally writes it
as JSON. FLOPs per token (6 x matmul parameters + 12 x layers x L x H x K, as in the PaLM
paper) are reported two ways: executed (the encoder's output layer at the step's max_predictions
positions per row) and nominal (at every position); XLA's own count of the compiled step is
printed too. MFU divides achieved FLOP/s by a matmul peak measured in the same process.

With --compare_hf (or --compare-hf), Hugging Face RoFormerForMaskedLM (encoder) or
RoFormerForCausalLM (decoder) of the same shape trains with torch AdamW in the same process; the
two alternate repeat by repeat and the ratio of the medians is printed. With
--config.model.dtype=bfloat16 the PyTorch forward runs under torch.autocast("cpu", bfloat16), the
counterpart of our bfloat16 compute with float32 weights. Both use every core, so run it on an
otherwise idle machine.

  JAX_PLATFORMS=cpu python benchmarks/throughput.py --config=configs/mlm.py \
    --config.model.num_layers=4 --config.model.emb_dim=256 --config.model.num_heads=4 \
    --config.model.mlp_dim=1024 --config.model.dropout_rate=0 --config.data.seq_len=256 \
    --config.train.global_batch_size=16 --compare_hf [--json=throughput.json]
  JAX_PLATFORMS=cpu python benchmarks/throughput.py --smoke   # seconds; what the test runs
"""

import json
import os
import statistics
import sys
import time

import bench_step
from absl import app, flags
from ml_collections import config_flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # the config files import configs.default

config_flags.DEFINE_config_file(
  "config", os.path.join(_REPO, "configs", "mlm.py"), "Training config file.", lock_config=True
)
flags.DEFINE_integer("steps", 5, "Timed train steps per repeat.")
flags.DEFINE_integer("repeats", 5, "Alternating repeats; the median is reported.")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compiling.")
flags.DEFINE_integer("peak_size", 2048, "Side of the square matmul that measures the peak.")
flags.DEFINE_bool("compare_hf", False, "Also time Hugging Face RoFormer in PyTorch.")
flags.DEFINE_bool("smoke", False, "Tiny model and a few steps (a test runs this).")
flags.DEFINE_string("json", "", "Write the results to this JSON file.")
FLAGS = flags.FLAGS

# A 2-layer, 32-wide model on 32-token windows: seconds on any CPU.
SMOKE = {
  "model.num_layers": 2,
  "model.emb_dim": 32,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
  "data.seq_len": 32,
  "data.vocab_size": 128,
  "train.global_batch_size": 4,
}


def _apply(config, overrides):
  for name, value in overrides.items():
    group, field = name.split(".")
    with config.unlocked():
      config[group][field] = value


def flops_per_token(run_config, *, head_fraction: float = 1.0) -> float:
  """6 x matmul parameters + 12 x layers x L x H x K (PaLM), the output layer at a fraction of L.

  head_fraction 1 gives the model's nominal FLOPs; the encoder's train step runs its output
  layer at max_predictions of the L positions (XLA's cost analysis cannot tell: it counts both
  branches of the step's lax.cond).
  """
  from roformer.nn import model as model_lib

  m = run_config.model
  D, F, V = m.emb_dim, m.mlp_dim, m.vocab_size
  E = m.embedding_size or D
  H, G, K = m.num_heads, model_lib.resolve_num_kv_heads(m), model_lib.resolve_head_dim(m)
  mlp = (3 if m.activation == "swiglu" else 2) * D * F
  per_layer = D * H * K * 2 + D * G * K * 2 + mlp
  head = V * E + (D * E if m.kind == "encoder" else 0)
  project = D * E if E != D else 0
  matmul_params = m.num_layers * per_layer + head * head_fraction + project
  return 6.0 * matmul_params + 12.0 * m.num_layers * run_config.data.seq_len * H * K


def executed_head_fraction(run_config) -> float:
  """Fraction of positions the train step runs the output layer at."""
  from roformer.train import step as step_lib

  capacity = step_lib.train_step_options(run_config)["max_predictions"]
  return capacity / run_config.data.seq_len if capacity else 1.0


def measure_peak(size: int, dtype: str) -> float:
  """FLOP/s of a jitted square matmul in `dtype` (median of 5)."""
  import jax
  import jax.numpy as jnp

  a = jnp.ones((size, size), dtype)
  f = jax.jit(lambda a, b: a @ b)
  f(a, a).block_until_ready()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    f(a, a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2.0 * size**3 / statistics.median(times)


class HfTrainer:
  """Hugging Face RoFormer of the same shape, trained with torch AdamW on the same batch."""

  def __init__(self, run_config):
    import numpy as np
    import torch
    import transformers

    m, o = run_config.model, run_config.optim
    E = m.embedding_size or m.emb_dim
    hf_config = transformers.RoFormerConfig(
      vocab_size=m.vocab_size,
      embedding_size=E,
      hidden_size=m.emb_dim,
      num_hidden_layers=m.num_layers,
      num_attention_heads=m.num_heads,
      intermediate_size=m.mlp_dim,
      hidden_act="gelu",
      hidden_dropout_prob=m.dropout_rate,
      attention_probs_dropout_prob=m.dropout_rate,
      max_position_embeddings=run_config.data.seq_len,
      type_vocab_size=max(m.type_vocab_size, 1),
      layer_norm_eps=m.norm_eps,
      is_decoder=m.kind == "decoder",
      tie_word_embeddings=m.tie_embeddings,
    )
    cls = transformers.RoFormerForMaskedLM
    if m.kind == "decoder":
      cls = transformers.RoFormerForCausalLM
    self.model = cls(hf_config).train()
    self.opt = torch.optim.AdamW(
      self.model.parameters(),
      lr=o.learning_rate,
      betas=(o.b1, o.b2),
      eps=o.eps,
      weight_decay=o.weight_decay,
    )
    batch = bench_step.synthetic_batch(run_config, np.random.default_rng(0))
    self.inputs = torch.from_numpy(batch["inputs"]).long()
    labels = batch["inputs"].astype(np.int64)
    if m.kind == "encoder":  # HF ignores label -100: loss on masked positions only
      labels = np.where(batch["weights"] > 0, batch["targets"], -100).astype(np.int64)
    self.labels = torch.from_numpy(labels)  # CausalLM shifts the labels itself
    self.clip = o.grad_clip_norm
    self.torch = torch
    # Our bfloat16 path (float32 master weights, bfloat16 matmuls) against PyTorch's counterpart:
    # the forward and loss under CPU autocast, the backward and AdamW outside it.
    self.autocast = m.dtype == "bfloat16"

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      with self.torch.autocast("cpu", dtype=self.torch.bfloat16, enabled=self.autocast):
        loss = self.model(input_ids=self.inputs, labels=self.labels).loss
      loss.backward()
      if self.clip > 0:
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
      self.opt.step()
      self.opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _hf_missing() -> str:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError as e:
    return (
      f"--compare_hf needs torch and transformers ({e}); install them with "
      "`pip install -c requirements.txt torch transformers`"
    )
  return ""


def benchmark(run_config, *, steps, repeats, warmup, peak_size, compare_hf) -> dict:
  """Compiles and times the train step (and HF's when asked); returns the results."""
  import jax

  tokens_per_step = run_config.train.global_batch_size * run_config.data.seq_len
  ours = bench_step.JaxTrainer(run_config)
  hf = HfTrainer(run_config) if compare_hf else None
  ours.run(warmup)
  if hf is not None:
    hf.run(warmup)
  ours_s, hf_s = [], []
  for _ in range(repeats):  # alternate, so both see the same machine load
    ours_s.append(ours.run(steps))
    if hf is not None:
      hf_s.append(hf.run(steps))
  tokens_per_sec = tokens_per_step * steps / statistics.median(ours_s)
  peak = measure_peak(peak_size, run_config.model.dtype)
  executed = flops_per_token(run_config, head_fraction=executed_head_fraction(run_config))
  nominal = flops_per_token(run_config)
  m = run_config.model
  result = {
    "kind": m.kind,
    "shape": (
      f"{m.num_layers}x{m.emb_dim} H{m.num_heads} F{m.mlp_dim} V{m.vocab_size} "
      f"B{run_config.train.global_batch_size} L{run_config.data.seq_len} {m.dtype}"
    ),
    "devices": f"{jax.device_count()} {jax.devices()[0].platform}",
    "compile_seconds": ours.compile_seconds,
    "tokens_per_sec": tokens_per_sec,
    "tokens_per_sec_runs": [tokens_per_step * steps / s for s in ours_s],
    "executed_flops_per_token": executed,
    "xla_flops_per_token": ours.flops_per_step / tokens_per_step,
    "nominal_flops_per_token": nominal,
    "peak_flops_per_sec": peak,
    "mfu_executed": executed * tokens_per_sec / peak,
    "mfu_nominal": nominal * tokens_per_sec / peak,
  }
  if hf is not None:
    result["hf_tokens_per_sec"] = tokens_per_step * steps / statistics.median(hf_s)
    result["hf_tokens_per_sec_runs"] = [tokens_per_step * steps / s for s in hf_s]
    result["ratio_to_hf"] = result["tokens_per_sec"] / result["hf_tokens_per_sec"]
    result["hf_precision"] = "bfloat16 autocast" if hf.autocast else "float32"
  return result


def format_table(result: dict) -> str:
  rows = [
    ("model", f"{result['kind']} {result['shape']}"),
    ("devices", result["devices"]),
    ("compile (s)", f"{result['compile_seconds']:.1f}"),
    ("tokens/s (median)", f"{result['tokens_per_sec']:,.0f}"),
    ("tokens/s (runs)", ", ".join(f"{x:,.0f}" for x in result["tokens_per_sec_runs"])),
    ("GFLOP/token executed", f"{result['executed_flops_per_token'] / 1e9:.4f}"),
    ("GFLOP/token nominal", f"{result['nominal_flops_per_token'] / 1e9:.4f}"),
    ("GFLOP/token XLA count", f"{result['xla_flops_per_token'] / 1e9:.4f}"),
    ("matmul peak (GFLOP/s)", f"{result['peak_flops_per_sec'] / 1e9:,.1f}"),
    ("MFU executed", f"{100 * result['mfu_executed']:.1f}%"),
    ("MFU nominal", f"{100 * result['mfu_nominal']:.1f}%"),
  ]
  if "hf_tokens_per_sec" in result:
    rows += [
      (f"HF PyTorch tokens/s ({result['hf_precision']})", f"{result['hf_tokens_per_sec']:,.0f}"),
      ("HF tokens/s (runs)", ", ".join(f"{x:,.0f}" for x in result["hf_tokens_per_sec_runs"])),
      ("ours / HF", f"{result['ratio_to_hf']:.2f}x"),
    ]
  width = max(len(name) for name, _ in rows)
  return "\n".join(f"| {name:<{width}} | {value} |" for name, value in rows)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = FLAGS.config
  steps, repeats, warmup, peak_size = FLAGS.steps, FLAGS.repeats, FLAGS.warmup, FLAGS.peak_size
  if FLAGS.smoke:
    _apply(config, SMOKE)
    steps, repeats, warmup, peak_size = 2, 2, 1, 256
  if FLAGS.compare_hf and (missing := _hf_missing()):
    print(f"throughput.py: error: {missing}", file=sys.stderr)
    sys.exit(1)
  from roformer.infra import cpu_flags

  cpu_flags.set_default_cpu_flags()  # as train.py does, before JAX starts
  from roformer import config as config_lib

  try:
    run_config = bench_step.run_config(config)
  except config_lib.ConfigError as e:
    print(f"throughput.py: error: {e}", file=sys.stderr)
    sys.exit(1)
  result = benchmark(
    run_config,
    steps=steps,
    repeats=repeats,
    warmup=warmup,
    peak_size=peak_size,
    compare_hf=FLAGS.compare_hf,
  )
  print(format_table(result))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  # absl spells flags with underscores; accept the dashed spelling too.
  sys.argv = [a.replace("--compare-hf", "--compare_hf") for a in sys.argv]
  app.run(main)
