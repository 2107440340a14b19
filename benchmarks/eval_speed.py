"""Evaluation tokens/s at long context, and Hugging Face's PyTorch forward side by side.

Scores one window of each length (batch 1, every token scored) with a randomly initialised
model of the config's shape through `roformer.evals.perplexity.evaluate_at_length`, the function
eval.py runs (blockwise: sequence blocks of the layers, and attention through `auto`: on a CPU
the fused `cpu_flash` kernel, elsewhere the chunked kernel beyond `model.attention_block`, so
memory stays linear in the length). With --compare_hf the Hugging
Face decoder of the same shape (benchmarks/hf_counterpart.py: LlamaForCausalLM or
GPTNeoXForCausalLM, SDPA attention; float32, or bf16 autocast for a bfloat16 config) computes the
same loss under torch.no_grad() on the same tokens, alternating with ours repeat by repeat; the
table gives the medians and their ratio. Compile time is excluded (each length is scored once
before timing). The PyTorch side runs where JAX does (`--hf_device=auto`: cuda on a GPU, JAX
then allocating memory as it needs it rather than 75% up front), or where --hf_device says.

  # the decoder of the speed comparison (Llama-style 4 x 256, bytes) at 2k, 8k and 32k tokens
  JAX_PLATFORMS=cpu python -m benchmarks.eval_speed --config=configs/lm.py \
    --config.model.num_layers=4 --config.model.emb_dim=256 --config.model.num_heads=4 \
    --config.model.mlp_dim=704 --config.model.activation=swiglu --config.model.norm=rmsnorm \
    --config.model.use_bias=False --config.model.tie_embeddings=False \
    --config.model.dropout_rate=0 --config.posenc.rope_layout=half --compare_hf
  JAX_PLATFORMS=cpu python -m benchmarks.eval_speed --smoke   # seconds; what the test runs
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from benchmarks import bench_step, hf_counterpart

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

config_flags.DEFINE_config_file(
  "config", os.path.join(_REPO, "configs", "lm.py"), "Training config file.", lock_config=True
)
flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Window lengths to score.")
flags.DEFINE_integer("repeats", 3, "Alternating timed repeats per length; the median is reported.")
flags.DEFINE_bool("compare_hf", False, "Time Hugging Face's PyTorch forward of the same shape.")
bench_step.define_keep_freed_memory_flag()
hf_counterpart.define_device_flag()
flags.DEFINE_bool("smoke", False, "Tiny model and short lengths (a test runs this).")
flags.DEFINE_string("json", "", "Write the results to this JSON file.")
FLAGS = flags.FLAGS

SMOKE = {
  "model.num_layers": 1,
  "model.emb_dim": 32,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
  "model.attention_block": 64,
}
SMOKE_LENGTHS = [64, 256]


class OursEval:
  """eval.py's scoring of one window of `length` random tokens."""

  def __init__(self, run_config, length: int):
    import numpy as np
    from flax import nnx

    from roformer.nn.model import make_model

    self.model = make_model(run_config.model, rngs=nnx.Rngs(run_config.train.seed))
    V = run_config.model.vocab_size
    # A prefix of `length` tokens, then `length` scored targets: exactly one window.
    self.tokens = np.random.default_rng(0).integers(0, V, 2 * length + 1).astype(np.int32)
    self.length = length

  def run(self) -> float:
    from roformer.evals import perplexity

    L = self.length
    start = time.perf_counter()
    result = perplexity.evaluate_at_length(
      self.model, self.tokens, length=L, protocol="nonoverlapping", stride=L, max_tokens=L,
      max_length=L, batch_size=1,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert result["tokens"] == L, result  # one window, every token scored
    return seconds


class TorchEval:
  """The Hugging Face counterpart's loss on the same window, no gradients, on torch's `device`
  (under bf16 autocast when the config computes in bfloat16)."""

  def __init__(self, run_config, counterpart, tokens, length: int, device: str = "cpu"):
    import torch
    import transformers

    torch.manual_seed(run_config.train.seed)
    self.torch, self.device = torch, device
    model = getattr(transformers, counterpart.name)(counterpart.config)
    self.model = model.float().to(device).eval()
    self.autocast = run_config.model.dtype == "bfloat16"
    window = torch.from_numpy(tokens[length : 2 * length + 1].astype("int64"))[None]
    # The causal LM shifts the labels itself, so it scores L - 1 of the window's tokens.
    self.inputs = self.labels = window[:, :-1].to(device)

  def run(self) -> float:
    torch = self.torch
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(self.device, torch.bfloat16, enabled=self.autocast):
      loss = self.model(input_ids=self.inputs, labels=self.labels).loss
    finite = bool(torch.isfinite(loss))  # waits for a GPU's queued kernels
    seconds = time.perf_counter() - start
    assert finite
    return seconds


def benchmark(run_config, lengths, *, repeats: int, compare_hf: bool, hf_device="cpu") -> dict:
  counterpart = hf_counterpart.hf_counterpart(run_config) if compare_hf else None
  rows = []
  for length in lengths:
    ours = OursEval(run_config, length)
    start = time.perf_counter()
    ours.run()  # compiles
    row = {"length": length, "first_call_seconds": time.perf_counter() - start}
    hf = TorchEval(run_config, counterpart, ours.tokens, length, hf_device) if compare_hf else None
    if hf is not None:
      hf.run()  # warm-up
    ours_s, hf_s = [], []
    for _ in range(repeats):  # alternate, so both see the same machine load
      ours_s.append(ours.run())
      if hf is not None:
        hf_s.append(hf.run())
    row["tokens_per_sec"] = length / statistics.median(ours_s)
    if hf is not None:
      row["hf_tokens_per_sec"] = length / statistics.median(hf_s)
      row["ratio_to_hf"] = row["tokens_per_sec"] / row["hf_tokens_per_sec"]
    rows.append(row)
    print(format_row(row), flush=True)
  m = run_config.model
  result = {
    "shape": f"{m.kind} {m.num_layers}x{m.emb_dim} H{m.num_heads} F{m.mlp_dim} V{m.vocab_size}",
    "attention": f"{m.attention_impl} (block {m.attention_block})",
    "rows": rows,
  }
  if counterpart is not None:
    result["hf_model"] = counterpart.name + (f" ({counterpart.note})" if counterpart.note else "")
    precision = "bf16 autocast" if m.dtype == "bfloat16" else "float32"
    result["hf_setup"] = f"{hf_device}, {precision}, torch.no_grad()"
  return result


HEADER = (
  "| length | ours tokens/s | first call (s) | HF tokens/s | ours / HF |\n|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
  hf = row.get("hf_tokens_per_sec")
  return (
    f"| {row['length']:,} | {row['tokens_per_sec']:,.0f} | {row['first_call_seconds']:.1f} | "
    + (f"{hf:,.0f} | {row['ratio_to_hf']:.2f}x |" if hf else "- | - |")
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = FLAGS.config
  lengths = [int(x) for x in FLAGS.lengths]
  repeats = FLAGS.repeats
  if FLAGS.smoke:
    bench_step.apply_overrides(config, SMOKE)
    lengths, repeats = SMOKE_LENGTHS, 1
  # Before torch is imported (missing() imports it): malloc is set before threads start.
  run_config = bench_step.run_config_or_exit(
    "eval_speed.py", config, keep_freed_memory=bench_step.keep_freed_memory(FLAGS.compare_hf)
  )
  hf_device = hf_counterpart.device_or_exit("eval_speed.py", FLAGS.compare_hf, FLAGS.hf_device)
  if run_config.model.kind != "decoder":
    print("eval_speed.py: error: model.kind must be 'decoder' (use configs/lm.py)", file=sys.stderr)
    sys.exit(1)
  m = run_config.model
  print(f"{m.kind} {m.num_layers}x{m.emb_dim}, attention {m.attention_impl}, batch 1")
  print(HEADER, flush=True)
  try:
    result = benchmark(
      run_config, lengths, repeats=repeats, compare_hf=FLAGS.compare_hf, hf_device=hf_device
    )
  except hf_counterpart.NoCounterpartError as e:
    print(f"eval_speed.py: error: --compare_hf: {e}", file=sys.stderr)
    sys.exit(1)
  if "hf_model" in result:
    print(f"HF model: transformers.{result['hf_model']}, {result['hf_setup']}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  sys.argv = [a.replace("--compare-hf", "--compare_hf") for a in sys.argv]
  app.run(main)
