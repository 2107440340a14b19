"""Training throughput of the real train step, FLOPs per token, MFU, and Hugging Face side by side.

Times train_lib's train step, jitted with the same shardings and donation as train.py, on
synthetic batches shaped like the config's (encoder: BERT-masked positions at
data.mlm_probability; decoder: every position scored). Prints one table and optionally writes it
as JSON. FLOPs per token (6 x matmul parameters + 12 x layers x L x H x K, as in the PaLM
paper) are reported two ways: executed (the encoder's output layer at the step's max_predictions
positions per row) and nominal (at every position); XLA's own count of the compiled step is
printed too, and our page faults per step in a middle repeat (memory the kernel maps in
afresh: see roformer.infra.cpu_flags.keep_freed_host_memory). MFU divides achieved FLOP/s by a
matmul peak measured in our process (times the devices); on a TPU or GPU of `CHIP_PEAK_BF16`
also by the chip's datasheet peak.

With --compare_hf (or --compare-hf), the Hugging Face model a user would otherwise train, of the
same shape, trains with torch AdamW (the same hyperparameters) on the same batch; the two
alternate repeat by repeat and the ratio of the medians is printed, with the HF class in the
table:
- encoder (MLM): RoFormerForMaskedLM;
- Llama-style decoder (model.activation=swiglu, model.norm=rmsnorm; biases and tied embeddings
  as the config says): LlamaForCausalLM (SDPA attention, rope_theta = posenc.max_wavelength);
- the default decoder block (gelu, layernorm, biases): GPTNeoXForCausalLM (sequential residual,
  exact GELU, SDPA, rotary_pct = posenc.rope_fraction).
Both HF decoders always run RoPE in half layout: for another posenc.kind (or an interleaved,
truncated or scaled RoPE) the table says what differs. A decoder that neither family reproduces
(e.g. swiglu with layernorm, linear or MLA attention, a sliding window) is refused, naming the
field. With
--config.model.dtype=bfloat16 the PyTorch forward runs under torch.autocast(bfloat16), the
counterpart of our bfloat16 compute with float32 weights. Both use every core, so run it on an
otherwise idle machine. The PyTorch side runs where JAX does (`--hf_device=auto`): on a GPU on
cuda, with fused AdamW, both sides sharing the GPU (JAX then allocates memory as it needs it,
not 75% up front); `--hf_device=cpu` or `=cuda` says where.

Each side runs in a child process of its own (benchmarks/alternate.py), as its users run it:
ours with train.py's malloc setting (`keep_freed_host_memory`, roformer.infra.cpu_flags), HF
with glibc's defaults. --keep_freed_memory=true or =false puts both under one setting (the
setting speeds PyTorch up as well, on the MLM encoder more than ours). --in_process times both
in this process instead, under one setting (default: glibc's).

  JAX_PLATFORMS=cpu python -m benchmarks.throughput --config=configs/mlm.py \
    --config.model.num_layers=4 --config.model.emb_dim=256 --config.model.num_heads=4 \
    --config.model.mlp_dim=1024 --config.model.dropout_rate=0 --config.data.seq_len=256 \
    --config.train.global_batch_size=16 --compare_hf [--json=throughput.json]
  # Llama-style decoder against LlamaForCausalLM: 4 x 256, 4 heads, SwiGLU 704, RMSNorm, no
  # biases, untied head, RoPE half layout, bytes vocabulary (261), batch 8 x 512, float32
  JAX_PLATFORMS=cpu python -m benchmarks.throughput --config=configs/lm.py \
    --config.model.num_layers=4 --config.model.emb_dim=256 --config.model.num_heads=4 \
    --config.model.mlp_dim=704 --config.model.activation=swiglu --config.model.norm=rmsnorm \
    --config.model.use_bias=False --config.model.tie_embeddings=False \
    --config.posenc.kind=rope --config.posenc.rope_layout=half --config.data.tokenizer=bytes \
    --config.data.seq_len=512 --config.train.global_batch_size=8 --config.model.dtype=float32 \
    --config.model.dropout_rate=0 --compare_hf
  JAX_PLATFORMS=cpu python -m benchmarks.throughput --smoke   # seconds; what the test runs
"""

import functools
import json
import os
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

from benchmarks import alternate, bench_step, hf_counterpart
from benchmarks.flops import CHIP_PEAK_BF16, executed_head_fraction, flops_per_token, measure_peak

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

config_flags.DEFINE_config_file(
  "config", os.path.join(_REPO, "configs", "mlm.py"), "Training config file.", lock_config=True
)
flags.DEFINE_integer("steps", 5, "Timed train steps per repeat.")
flags.DEFINE_integer("repeats", 5, "Alternating repeats; the median is reported.")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compiling.")
flags.DEFINE_integer("peak_size", 2048, "Side of the square matmul that measures the peak.")
flags.DEFINE_bool(
  "compare_hf", False, "Also time the Hugging Face PyTorch model of the same shape (see above)."
)
flags.DEFINE_bool(
  "in_process",
  False,
  "With --compare_hf, time both sides in this process, under one malloc setting (default: off)"
  " instead of a child process each.",
)
bench_step.define_keep_freed_memory_flag()
hf_counterpart.define_device_flag()
flags.DEFINE_enum("serve", "", ["", "ours", "hf"], "Internal: serve one side to --compare_hf.")
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


def _measured_peak(run_config, peak_size: int) -> dict:
  """The matmul peak of all devices, measured here, and the datasheet peak of a known chip."""
  import jax

  devices = jax.device_count()
  kind = jax.devices()[0].device_kind
  return {
    "devices": f"{devices} {jax.devices()[0].platform} ({kind})",
    # One device measured; the step runs on all of them.
    "peak_flops_per_sec": measure_peak(peak_size, run_config.model.dtype) * devices,
    "chip_peak_flops_per_sec": CHIP_PEAK_BF16.get(kind, 0.0) * devices,
  }


def make_side(
  name: str, run_config, *, warmup: int, peak_size: int, hf_device: str = "cpu"
) -> alternate.InProcess:
  """Our train step ("ours") or the Hugging Face model's ("hf", on torch's `hf_device`), built
  and warmed up here; its info names the process and whether it keeps freed memory."""
  from roformer.infra import cpu_flags

  where = {"pid": os.getpid(), "keeps_freed_memory": cpu_flags.freed_memory_kept()}
  if name == "ours":
    trainer = bench_step.JaxTrainer(run_config)
    info = lambda: {  # noqa: E731  (after the timed runs: the peak runs last)
      "compile_seconds": trainer.compile_seconds,
      "flops_per_step": trainer.flops_per_step,
      **_measured_peak(run_config, peak_size),
      **where,
    }
  else:
    counterpart = hf_counterpart.hf_counterpart(run_config)
    trainer = hf_counterpart.TorchTrainer(run_config, counterpart, device=hf_device)
    info = lambda: {  # noqa: E731
      "hf_model": trainer.name,
      "hf_note": trainer.note,
      "hf_precision": f"{hf_device}, " + ("bfloat16 autocast" if trainer.autocast else "float32"),
      **where,
    }
  trainer.run(warmup)
  return alternate.InProcess(trainer, info)


def setup(infos: list[dict]) -> str:
  """How ours and HF ran, from what their processes report."""
  ours, hf = infos
  where = "one process" if ours["pid"] == hf["pid"] else "a process each"
  malloc = {True: "malloc keeping freed memory", False: "glibc's default malloc"}
  kept = ours["keeps_freed_memory"], hf["keeps_freed_memory"]
  if kept[0] == kept[1]:
    return f"{where}, both with {malloc[kept[0]]}"
  return f"{where}; ours with {malloc[kept[0]]}, HF with {malloc[kept[1]]}"


def benchmark(
  run_config, *, steps, repeats, warmup, peak_size, compare_hf, child_cmd=None, hf_device="cpu"
) -> dict:
  """Times our train step (and HF's on `hf_device` when asked, the two in turn); returns the
  results.

  With `child_cmd(side)` (the command line of a `--serve=side` process), each side runs in a
  child process of its own; else both run in this one.
  """
  if compare_hf:
    hf_counterpart.hf_counterpart(run_config)  # refuses before compiling
  names = ["ours", "hf"] if compare_hf else ["ours"]
  sides, infos, done = [], [], False
  try:
    for name in names:  # one after the other: each compiles and warms up on an idle machine
      if child_cmd:
        sides.append(alternate.ChildProcess(child_cmd(name), name, env=bench_step.child_env()))
        sides[-1].wait_ready()
      else:
        sides.append(
          make_side(name, run_config, warmup=warmup, peak_size=peak_size, hf_device=hf_device)
        )
    runs = alternate.alternate(sides, steps, repeats)
    infos = [side.info() for side in sides]
    done = True
  finally:
    for side in sides:
      side.close(wait=done)
  return assemble(run_config, steps, runs, infos)


def assemble(run_config, steps: int, runs: list, infos: list[dict]) -> dict:
  """The result table's entries from the sides' (seconds, faults) runs and their info."""
  tokens_per_step = run_config.train.global_batch_size * run_config.data.seq_len
  info = infos[0]
  ours_s = [seconds for seconds, _ in runs[0]]
  # A middle repeat (the lower of two): the first maps in the heap's peak (steps in flight) once.
  faults = statistics.median_low(f for _, f in runs[0])
  tokens_per_sec = tokens_per_step * steps / statistics.median(ours_s)
  executed = flops_per_token(run_config, head_fraction=executed_head_fraction(run_config))
  nominal = flops_per_token(run_config)
  peak, chip_peak = info["peak_flops_per_sec"], info["chip_peak_flops_per_sec"]
  m = run_config.model
  result = {
    "kind": m.kind,
    "shape": (
      f"{m.num_layers}x{m.emb_dim} H{m.num_heads} F{m.mlp_dim} V{m.vocab_size} "
      f"B{run_config.train.global_batch_size} L{run_config.data.seq_len} {m.dtype}"
    ),
    "devices": info["devices"],
    "compile_seconds": info["compile_seconds"],
    # Pages the kernel mapped in for our steps (fresh memory: see keep_freed_host_memory).
    "page_faults_per_step": faults / steps,
    "tokens_per_sec": tokens_per_sec,
    "tokens_per_sec_runs": [tokens_per_step * steps / s for s in ours_s],
    "executed_flops_per_token": executed,
    "xla_flops_per_token": info["flops_per_step"] / tokens_per_step,
    "nominal_flops_per_token": nominal,
    "peak_flops_per_sec": peak,
    "mfu_executed": executed * tokens_per_sec / peak,
    "mfu_nominal": nominal * tokens_per_sec / peak,
    "chip_peak_flops_per_sec": chip_peak,
    "mfu_chip": executed * tokens_per_sec / chip_peak if chip_peak else None,
  }
  if len(runs) > 1:
    hf_s = [seconds for seconds, _ in runs[1]]
    result["hf_tokens_per_sec"] = tokens_per_step * steps / statistics.median(hf_s)
    result["hf_tokens_per_sec_runs"] = [tokens_per_step * steps / s for s in hf_s]
    result["ratio_to_hf"] = result["tokens_per_sec"] / result["hf_tokens_per_sec"]
    hf = infos[1]
    result.update({k: hf[k] for k in ("hf_model", "hf_note", "hf_precision")})
    result["setup"] = setup(infos)
  return result


def format_table(result: dict) -> str:
  rows = [
    ("model", f"{result['kind']} {result['shape']}"),
    ("devices", result["devices"]),
    ("compile (s)", f"{result['compile_seconds']:.1f}"),
    ("tokens/s (median)", f"{result['tokens_per_sec']:,.0f}"),
    ("tokens/s (runs)", ", ".join(f"{x:,.0f}" for x in result["tokens_per_sec_runs"])),
    ("page faults / step (middle repeat)", f"{result['page_faults_per_step']:,.0f}"),
    ("GFLOP/token executed", f"{result['executed_flops_per_token'] / 1e9:.4f}"),
    ("GFLOP/token nominal", f"{result['nominal_flops_per_token'] / 1e9:.4f}"),
    ("GFLOP/token XLA count", f"{result['xla_flops_per_token'] / 1e9:.4f}"),
    ("matmul peak (GFLOP/s)", f"{result['peak_flops_per_sec'] / 1e9:,.1f}"),
    ("MFU executed", f"{100 * result['mfu_executed']:.1f}%"),
    ("MFU nominal", f"{100 * result['mfu_nominal']:.1f}%"),
  ]
  if result.get("mfu_chip") is not None:  # a TPU or GPU of the datasheet table
    rows += [
      ("chip peak bf16 (TFLOP/s, datasheet)", f"{result['chip_peak_flops_per_sec'] / 1e12:,.0f}"),
      ("MFU executed, of the chip peak", f"{100 * result['mfu_chip']:.1f}%"),
    ]
  if "hf_tokens_per_sec" in result:
    hf_model = result["hf_model"] + (f" ({result['hf_note']})" if result["hf_note"] else "")
    rows += [
      ("HF model", f"transformers.{hf_model}"),
      ("setup", result["setup"]),
      (f"HF PyTorch tokens/s ({result['hf_precision']})", f"{result['hf_tokens_per_sec']:,.0f}"),
      ("HF tokens/s (runs)", ", ".join(f"{x:,.0f}" for x in result["hf_tokens_per_sec_runs"])),
      ("ours / HF", f"{result['ratio_to_hf']:.2f}x"),
    ]
  width = max(len(name) for name, _ in rows)
  return "\n".join(f"| {name:<{width}} | {value} |" for name, value in rows)


def _child_cmd(side: str, hf_device: str) -> list[str]:
  """This script's command line, serving `side` in a child process as its users run it (ours
  keeping freed memory, HF not) unless --keep_freed_memory says, HF on `hf_device`; the flags
  appended last win, and the child writes no JSON."""
  keep = side == "ours" if FLAGS.keep_freed_memory is None else FLAGS.keep_freed_memory
  return [sys.executable, "-m", "benchmarks.throughput", *sys.argv[1:], f"--serve={side}",
          f"--keep_freed_memory={keep}", f"--hf_device={hf_device}"]  # fmt: skip


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = FLAGS.config
  steps, repeats, warmup, peak_size = FLAGS.steps, FLAGS.repeats, FLAGS.warmup, FLAGS.peak_size
  if FLAGS.smoke:
    bench_step.apply_overrides(config, SMOKE)
    steps, repeats, warmup, peak_size = 2, 2, 1, 256
  if FLAGS.serve:  # a child process of --compare_hf: one side, driven over stdin
    keep = bool(FLAGS.keep_freed_memory)  # the parent always says
    run_config = bench_step.run_config_or_exit("throughput.py", config, keep_freed_memory=keep)
    side = make_side(
      FLAGS.serve, run_config, warmup=warmup, peak_size=peak_size, hf_device=FLAGS.hf_device
    )
    alternate.serve(side)
    return
  # Before torch is imported (missing() imports it): malloc is set before threads start. Only
  # with --compare_hf --in_process does the HF model run in this process.
  separate = FLAGS.compare_hf and not FLAGS.in_process
  keep = bench_step.keep_freed_memory(FLAGS.compare_hf and not separate)
  run_config = bench_step.run_config_or_exit("throughput.py", config, keep_freed_memory=keep)
  hf_device = hf_counterpart.device_or_exit("throughput.py", FLAGS.compare_hf, FLAGS.hf_device)
  try:
    result = benchmark(
      run_config,
      steps=steps,
      repeats=repeats,
      warmup=warmup,
      peak_size=peak_size,
      compare_hf=FLAGS.compare_hf,
      child_cmd=functools.partial(_child_cmd, hf_device=hf_device) if separate else None,
      hf_device=hf_device,
    )
  except hf_counterpart.NoCounterpartError as e:
    print(f"throughput.py: error: --compare_hf: {e}", file=sys.stderr)
    sys.exit(1)
  except alternate.ChildError as e:
    print(f"throughput.py: error: {e}", file=sys.stderr)
    sys.exit(1)
  print(format_table(result))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  # absl spells flags with underscores; accept the dashed spelling too.
  sys.argv = [a.replace("--compare-hf", "--compare_hf") for a in sys.argv]
  app.run(main)
