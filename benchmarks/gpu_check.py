"""One command that checks a GPU end to end and prints one table as it goes (docs/gpu.md):

- throughput: the 12-layer, 768-wide Llama-style decoder (SwiGLU 2048, RMSNorm, no biases, untied
  head, RoPE; bytes vocabulary), 16 x 2048 tokens, bfloat16: tokens/s, MFU (6N + 12 L H K T
  FLOPs per token, benchmarks/flops.py's count, over the chip's datasheet bf16 peak, else a
  measured matmul peak) and peak device memory; then LlamaForCausalLM of the same shape (torch
  AdamW, bf16 autocast), eager and through torch.compile, when torch and transformers are
  installed (benchmarks/hf_counterpart.py), eager also on the long sequence below;
- long_context: the same model on one 32,768-token sequence, then with its position-wise layers in
  sequence blocks of 8,192 tokens instead of 512;
- first_step: seconds from `train.py` start to its first step, cold (an empty compilation
  cache) and warm (the same cache, a new run);
- cudnn: for each encoding `attention_impl=auto` sends to cuDNN, its loss (the outputs' mean
  square) and gradients in bfloat16 against the float32 oracle (`oracle.reference_attention`),
  relative errors;
- quickstart: `train.py --config=configs/quickstart.py`: seconds, the last train and eval loss;
- fallback: what runs where cuDNN refuses a call (sink logits here): a 4-layer model of the same
  width, 16 x 2048, through each XLA kernel and block (`FALLBACK`; `dense` also unsplit, as the
  plain one-block formulation), tokens/s and compile seconds,
  so that the platform's choice is made on numbers (docs/gpu.md).

Each part runs in a process of its own (its own device memory; JAX or PyTorch alone on the GPU),
under its own time limit and within the whole run's budget (--budget, 470 s: a part that would
start past it is one line, skipped); a part whose packages are missing is one line saying which,
and is skipped. A part prints each row when it has it, so one stopped at its limit keeps the rows
it finished. The JSON holds every row, and each part's seconds.

  python -m benchmarks.gpu_check [--json=gpu_check.json] [--parts=throughput,cudnn]
  JAX_PLATFORMS=cpu python -m benchmarks.gpu_check --smoke   # tiny shapes on a CPU; checks itself
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_bool("smoke", False, "Tiny shapes on any machine; fails unless its table is whole.")
flags.DEFINE_list("parts", [], "Parts to run (default: all, in order).")
flags.DEFINE_string("json", "gpu_check.json", "Write every row here ('' = nowhere).")
flags.DEFINE_integer("budget", 470, "Seconds for the whole run; parts past it are skipped.")
flags.DEFINE_string("serve", "", "Internal: run one part and print its rows as JSON.")
FLAGS = flags.FLAGS

# The model is bench_step.LLAMA_12x768 (12 x 768, Llama-style, on configs/lm.py).
FULL = {"batch": 16, "seq_len": 2048, "long": 32768, "long_block": 8192, "steps": 10,
        "cudnn_len": 1024, "heads": 8}  # fmt: skip
SMOKE = {"batch": 2, "seq_len": 32, "long": 128, "long_block": 64, "steps": 2, "cudnn_len": 32,
         "heads": 2}  # fmt: skip
SMOKE_MODEL = {"model.num_layers": 1, "model.emb_dim": 32, "model.num_heads": 2,
               "model.mlp_dim": 64, "model.dtype": "float32"}  # fmt: skip
SMOKE_ENCODINGS = ("rope", "alibi", "t5")  # one of each way to the logits cuDNN takes
# (model.attention_impl, model.attention_block) of the fallback part, today's `auto` choice first
# (chunked at the default block); the block also sets the MLP's sequence block (Block's seqwise).
# "dense unsplit" is `dense` with causal attention in one [L, S] block (the plain formulation: one
# pair of GEMMs a layer) instead of its causal query blocks, which skip the masked keys' work and
# were sized for XLA:CPU's GEMMs (`dense.CAUSAL_MAX_BLOCKS`).
FALLBACK = (("chunked", 512), ("chunked", 1024), ("chunked", 256), ("dense", 512),
            ("dense unsplit", 512))  # fmt: skip
SMOKE_FALLBACK = (("chunked", 16), ("dense", 16), ("dense unsplit", 16))


# ---- Parts (each runs in a child process: `--serve=NAME`) ----


def _run_config(sizes: dict, *, seq_len: int, batch: int, overrides: dict | None = None):
  """The 12 x 768 decoder's run config (tiny under --smoke), with `overrides` ({"group.field":
  value}) last."""
  from benchmarks import bench_step
  from configs import lm

  config = lm.get_config()
  fields = {**bench_step.LLAMA_12x768, **(SMOKE_MODEL if FLAGS.smoke else {})}
  fields |= {"data.seq_len": seq_len, "train.global_batch_size": batch, **(overrides or {})}
  for name, value in fields.items():
    bench_step.apply_overrides(config, {name: value})
  return bench_step.run_config(config)


def _peak(kind: str, dtype: str) -> tuple[float, str]:
  """The device's bf16 peak FLOP/s (datasheet where known, else measured) and where it is from."""
  from benchmarks import flops as flops_lib

  if kind in flops_lib.CHIP_PEAK_BF16:
    return flops_lib.CHIP_PEAK_BF16[kind], "datasheet"
  return flops_lib.measure_peak(1024 if FLAGS.smoke else 4096, dtype), "measured matmul"


def _timed(run_config, steps: int) -> tuple[float, float]:
  """(tokens/s over `steps` train steps after one untimed step, compile seconds)."""
  from benchmarks import bench_step

  trainer = bench_step.JaxTrainer(run_config)
  trainer.run(1)
  seconds = trainer.run(steps)
  tokens = run_config.train.global_batch_size * run_config.data.seq_len * steps
  return tokens / seconds, trainer.compile_seconds


def _ours(sizes: dict, *, seq_len: int, batch: int, label: str, overrides=None) -> list[dict]:
  """Rows of our train step's speed, MFU, compile time and peak memory (`overrides` as
  `_run_config` takes them). The memory is the process's peak so far: run this first."""
  import jax

  from benchmarks import flops as flops_lib

  run_config = _run_config(sizes, seq_len=seq_len, batch=batch, overrides=overrides)
  tokens_per_sec, compile_seconds = _timed(run_config, sizes["steps"])
  device = jax.devices()[0]
  peak, source = _peak(device.device_kind, run_config.model.dtype)
  flops = flops_lib.flops_per_token(run_config)
  stats = device.memory_stats() or {}
  memory = stats.get("peak_bytes_in_use")
  where = f"{device.device_kind}, {batch} x {seq_len}, {run_config.model.dtype}"
  return [
    _row(f"{label} tokens/s", tokens_per_sec, where),
    _row(f"{label} MFU", flops * tokens_per_sec / peak, f"{flops / 1e9:.3f} GFLOP/token, {source}"),
    _row(f"{label} compile s", compile_seconds, "the train step"),
    _row(f"{label} peak memory GiB", memory / 2**30 if memory else None, "device peak in use"),
  ]


def part_throughput(sizes):
  return _ours(sizes, seq_len=sizes["seq_len"], batch=sizes["batch"], label="ours")


def part_long_context(sizes):
  """One long sequence; then the same with the MLP and output projection in sequence blocks of
  `long_block` tokens instead of model.attention_block's 512 (cuDNN's attention takes no block:
  the second run isolates the sequence loop of the position-wise layers, 64 iterations a layer
  at 32k)."""
  yield from _ours(sizes, seq_len=sizes["long"], batch=1, label="ours 1 x long")
  block = sizes["long_block"]
  label = f"ours 1 x long, seq block {block}"
  blocks = {"model.attention_block": block}
  rows = _ours(sizes, seq_len=sizes["long"], batch=1, label=label, overrides=blocks)
  yield from (row for row in rows if "memory" not in row["metric"])  # the peak of both runs


def _hf(sizes, *, compile: bool, seq_len: int, batch: int, suffix: str = "") -> list[dict]:
  """Rows of LlamaForCausalLM's train step of our model's shape, on the GPU when torch sees one:
  tokens/s, MFU and the peak memory of this run (the peak is reset first)."""
  import gc

  import torch

  from benchmarks import flops as flops_lib
  from benchmarks import hf_counterpart

  run_config = _run_config(sizes, seq_len=seq_len, batch=batch)
  device = hf_counterpart.torch_device("auto")  # cuda where JAX would take the GPU too
  gc.collect()  # an earlier trainer's tensors
  if device == "cuda":
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
  counterpart = hf_counterpart.hf_counterpart(run_config)
  trainer = hf_counterpart.TorchTrainer(run_config, counterpart, device=device, compile=compile)
  trainer.run(2)  # torch.compile compiles here
  seconds = trainer.run(sizes["steps"])
  tokens_per_sec = batch * seq_len * sizes["steps"] / seconds
  kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
  peak, source = _peak(kind, run_config.model.dtype)
  flops = flops_lib.flops_per_token(run_config)
  label = f"HF {counterpart.name}" + (" torch.compile" if compile else " eager") + suffix
  memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
  return [
    _row(
      f"{label} tokens/s", tokens_per_sec, f"{kind}, {batch} x {seq_len}, torch {torch.__version__}"
    ),
    _row(f"{label} MFU", flops * tokens_per_sec / peak, source),
    _row(f"{label} peak memory GiB", memory, "torch.cuda.max_memory_allocated"),
  ]


def part_hf_eager(sizes):
  """LlamaForCausalLM eager at 16 x 2048, then on one long sequence (long_context's shape)."""
  yield from _hf(sizes, compile=False, seq_len=sizes["seq_len"], batch=sizes["batch"])
  yield from _hf(sizes, compile=False, seq_len=sizes["long"], batch=1, suffix=" 1 x long")


def part_hf_compile(sizes):
  return _hf(sizes, compile=True, seq_len=sizes["seq_len"], batch=sizes["batch"])


def _train_cmd(config: str, workdir: str, overrides: dict, *extra: str) -> list[str]:
  """train.py with configs/`config` and its overrides."""
  return [
    sys.executable, os.path.join(REPO, "train.py"), f"--config={REPO}/configs/{config}",
    f"--workdir={workdir}", *(f"--config.{name}={value}" for name, value in overrides.items()),
    *extra,
  ]  # fmt: skip


def _seconds_to_first_step(cmd: list[str], timeout: float) -> float:
  """Wall seconds from the process's start to its log line of step 1."""
  start = time.perf_counter()
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
    first, tail = None, []
    for line in p.stdout:
      tail = [*tail[-20:], line]
      if first is None and re.search(r"\bstep 1/\d+", line):
        first = time.perf_counter() - start
      if time.perf_counter() - start > timeout:
        p.kill()
    if p.wait() != 0 or first is None:
      raise RuntimeError("train.py failed: " + "".join(tail[-5:]))
  return first


def part_first_step(sizes):
  from benchmarks import bench_step

  overrides = {**bench_step.LLAMA_12x768, **(SMOKE_MODEL if FLAGS.smoke else {})}
  overrides |= {
    "data.seq_len": sizes["seq_len"],
    "train.global_batch_size": sizes["batch"],
    "train.num_train_steps": 1,
    "train.eval_max_tokens": 0,
    "train.checkpoint_every_steps": 0,
  }
  with tempfile.TemporaryDirectory() as tmp:
    if not FLAGS.smoke:  # (seconds of imports a smoke run does without)
      from roformer import data as data_lib

      # The token cache first: the cold start then times compilation, not a first tokenization.
      run_config = _run_config(sizes, seq_len=sizes["seq_len"], batch=sizes["batch"])
      data_lib.load_corpus(run_config.data, workdir=f"{tmp}/tokens")
    for name in ("cold", "warm"):  # a new run each time, with one compilation cache
      run = _train_cmd("lm.py", f"{tmp}/{name}", overrides, f"--compilation_cache_dir={tmp}/xla")
      seconds = _seconds_to_first_step(run, timeout=300)
      yield _row(f"first step, {name} s", seconds, "train.py start to step 1")


def part_cudnn(sizes):
  """Each encoding `auto` sends to cuDNN: its bf16 loss and gradients against the oracle (rows
  as each encoding is done)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from roformer.nn.attention.call import AttentionCall
  from roformer.nn.attention.kernels import KERNELS, cudnn
  from roformer.nn.attention.oracle import reference_attention
  from roformer.posenc import POSENCS, make_posenc
  from roformer.posenc.config import PosEncConfig

  on_gpu = jax.default_backend() == "gpu"
  kernel = KERNELS["cudnn"].call if on_gpu else KERNELS["cudnn"].emulated
  B, L, H, K = 2, sizes["cudnn_len"], sizes["heads"], 64 if on_gpu else 16
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, L, H, K)), jnp.float32) for _ in range(3))
  pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  kinds = SMOKE_ENCODINGS if FLAGS.smoke else tuple(POSENCS)
  for kind in kinds:
    with nnx.use_eager_sharding(False):
      posenc = make_posenc(
        PosEncConfig(kind=kind, max_len=max(L, 512)), num_heads=H, head_dim=K, emb_dim=H * K,
        causal=True, rngs=nnx.Rngs(3),
      )  # fmt: skip
    qr, kr = posenc.rotate(q, k, pos, pos, posenc.prepare(pos))
    call = AttentionCall(
      causal=True, bias_fn=posenc.bias, bias_factors_fn=posenc.bias_factors,
      content_bias_fn=posenc.content_bias,
    )  # fmt: skip
    args16 = [x.astype(jnp.bfloat16) for x in (qr, kr, v)]
    features = call.features(*args16, pos, pos, platform="gpu")
    if cudnn.misfit(features) or cudnn.auto_misfit(features):
      continue  # auto does not send this encoding to cuDNN

    def loss_grads(fn, args, call=call):
      def loss(q, k, v):
        # The mean square of the outputs: a positive loss, so its relative error is well posed.
        return jnp.mean(jnp.square(fn(q, k, v, pos, pos, call).astype(jnp.float32)))

      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)

    got = loss_grads(kernel, args16)
    want = loss_grads(reference_attention, [x.astype(jnp.float32) for x in args16])
    err = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())  # noqa: E731
    loss_err = err(got[0], want[0])
    grad_err = max(err(a, b) for a, b in zip(got[1], want[1], strict=True))
    yield _row(f"cudnn {kind}: loss rel err", loss_err, "mean(o^2), bf16 vs f32 oracle")
    yield _row(f"cudnn {kind}: grad rel err", grad_err, "max over q, k, v")


# The cuDNN adapter in bfloat16 against the float32 oracle, relative to the largest magnitude (the
# conformance test's bfloat16 tolerance).
BF16_TOLERANCE = 3e-2
QUICKSTART_CPU = "step 700 train_loss 1.3552, eval_loss 1.4653 on a CPU"


def part_quickstart(sizes):
  overrides = {}
  if FLAGS.smoke:
    overrides = {"model.num_layers": 1, "train.num_train_steps": 2,
                 "train.eval_max_tokens": 1024, "train.checkpoint_every_steps": 0}  # fmt: skip
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    done = subprocess.run(
      _train_cmd("quickstart.py", tmp, overrides), capture_output=True, text=True, timeout=600
    )
    seconds = time.perf_counter() - start
    if done.returncode:
      raise RuntimeError("train.py failed: " + done.stderr[-500:])
    with open(os.path.join(tmp, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
  last = lambda key: [r[key] for r in records if key in r][-1]  # noqa: E731
  return [
    _row("quickstart s", seconds, "train.py, train and evaluation"),
    _row("quickstart train_loss", last("train_loss"), QUICKSTART_CPU),
    _row("quickstart eval_loss", last("eval_loss"), ""),
  ]


def part_fallback(sizes):
  """Where cuDNN refuses a call (sink logits: model.attention_sinks), each XLA kernel and block
  trains a 4-layer model of the 12 x 768 decoder's width; yields a row per kernel as it is done."""
  from roformer.nn.attention.kernels import dense

  layers = 1 if FLAGS.smoke else 4
  split = dense.CAUSAL_MAX_BLOCKS
  for name, block in SMOKE_FALLBACK if FLAGS.smoke else FALLBACK:
    impl, _, variant = name.partition(" ")
    # Read when the step is traced (in _timed), so it holds for this row's program only.
    dense.CAUSAL_MAX_BLOCKS = 1 if variant == "unsplit" else split
    overrides = {"model.num_layers": layers, "model.attention_sinks": True,
                 "model.attention_impl": impl, "model.attention_block": block}  # fmt: skip
    run_config = _run_config(
      sizes, seq_len=sizes["seq_len"], batch=sizes["batch"], overrides=overrides
    )
    tokens_per_sec, compile_seconds = _timed(run_config, sizes["steps"])
    note = f"compile {compile_seconds:.1f} s; {layers} layers, sinks, {run_config.model.dtype}"
    if impl == "dense":
      note += f", {len(dense.causal_query_blocks(sizes['seq_len']))} causal query block(s)"
    yield _row(f"fallback {name}, block {block} tokens/s", tokens_per_sec, note)
  dense.CAUSAL_MAX_BLOCKS = split


# name: (function, the packages it needs, its time limit in seconds)
PARTS = {
  "throughput": (part_throughput, ("ml_collections",), 200),
  "hf_eager": (part_hf_eager, ("ml_collections", "torch", "transformers"), 120),
  "hf_compile": (part_hf_compile, ("ml_collections", "torch", "transformers"), 150),
  "cudnn": (part_cudnn, (), 120),
  "long_context": (part_long_context, ("ml_collections",), 150),
  "first_step": (part_first_step, ("ml_collections", "datasets"), 300),
  "quickstart": (part_quickstart, ("ml_collections", "datasets"), 240),
  "fallback": (part_fallback, ("ml_collections",), 240),
}


# ---- The table ----


ROW = "@@row "  # a part's row on its stdout (the line's prefix)


def _row(metric: str, value, note: str = "") -> dict:
  return {"metric": metric, "value": value, "note": note}


def _format(part: str, row: dict) -> str:
  value = row["value"]
  if isinstance(value, float):
    text = f"{value:.2e}" if abs(value) < 1e-2 and value else f"{value:,.3f}"
    if "MFU" in row["metric"]:
      text = f"{100 * value:.1f}%"
  else:
    text = "-" if value is None else str(value)
  return f"| {part:<12} | {row['metric']:<50} | {text:>14} | {row['note']} |"


def _missing(modules) -> list[str]:
  return [m for m in modules if importlib.util.find_spec(m) is None]


def _part_cmd(name: str) -> list[str]:
  """The command line of the child process that runs part `name`."""
  return [sys.executable, "-m", "benchmarks.gpu_check", f"--serve={name}"] + (
    ["--smoke"] if FLAGS.smoke else []
  )


def _run_part(name: str, limit: float, shared_cache: str) -> tuple[str, list[dict]]:
  """(status, rows) of one part, run in a child process within `limit` seconds.

  The parts that time our step share one compilation cache (`shared_cache`): the 32k sequence
  loads the model initialiser the throughput part compiled. first_step and quickstart time
  train.py with its own cache settings."""
  cmd = _part_cmd(name)
  env = dict(os.environ)
  if name not in ("first_step", "quickstart"):
    env["JAX_COMPILATION_CACHE_DIR"] = shared_cache
  # A session of its own: a part past its limit is stopped with the train.py it started.
  with subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    start_new_session=True,
  ) as p:  # fmt: skip
    try:
      stdout, stderr = p.communicate(timeout=limit)
      status = "ok" if p.returncode == 0 else None
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      stdout, stderr = p.communicate()  # what it printed before: the rows it finished
      status = f"timed out after {limit:.0f} s"
  rows = [json.loads(line[len(ROW) :]) for line in stdout.splitlines() if line.startswith(ROW)]
  if status is None:
    last = (stderr.strip().splitlines() or ["no output"])[-1]
    status = f"failed: {last[:160]}"
  return status, rows


def check_smoke(results: dict) -> list[str]:
  """What is wrong with a --smoke table: a part that neither ran nor was skipped for a missing
  package, a part with no rows, a value that is not a finite number (memory may be unknown), a
  cuDNN relative error past bfloat16's tolerance."""
  problems = []
  for name, result in results.items():
    status = result["status"]
    if status.startswith("skipped: needs"):
      continue
    if status != "ok":
      problems.append(f"{name}: {status}")
    elif not result["rows"]:
      problems.append(f"{name}: no rows")
    for row in result["rows"]:
      value = row["value"]
      if value is None and "memory" in row["metric"]:
        continue
      if not isinstance(value, int | float) or not math.isfinite(value):
        problems.append(f"{name}: {row['metric']} = {value!r}")
      elif "rel err" in row["metric"] and value > BF16_TOLERANCE:
        problems.append(f"{name}: {row['metric']} = {value:.2e} > {BF16_TOLERANCE}")
  return problems


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  sizes = SMOKE if FLAGS.smoke else FULL
  if FLAGS.serve:
    for row in PARTS[FLAGS.serve][0](sizes):  # a list, or a generator's rows as they come
      print(ROW + json.dumps(row), flush=True)
    return
  names = FLAGS.parts or list(PARTS)
  if unknown := [n for n in names if n not in PARTS]:
    raise app.UsageError(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(PARTS)}")
  start = time.perf_counter()
  results = {}
  shared_cache = tempfile.mkdtemp(prefix="gpu_check_xla_")
  print(f"| {'part':<12} | {'metric':<50} | {'value':>14} | note |", flush=True)
  for name in names:
    _, needs, limit = PARTS[name]
    left = FLAGS.budget - (time.perf_counter() - start)
    if missing := _missing(needs):
      status = f"skipped: needs {', '.join(missing)} (not installed)"
      rows = []
    elif left < 10:
      status, rows = "skipped: out of the run's time budget", []
    else:
      part_start = time.perf_counter()
      status, rows = _run_part(name, min(limit, left), shared_cache)
      rows.append(_row("part s", time.perf_counter() - part_start, f"limit {min(limit, left):.0f}"))
    results[name] = {"status": status, "rows": rows}
    for row in rows:
      print(_format(name, row), flush=True)
    if status != "ok":
      print(f"| {name:<12} | {status}", flush=True)
  shutil.rmtree(shared_cache, ignore_errors=True)
  total = time.perf_counter() - start
  print(f"total {total:.0f} s", flush=True)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"smoke": FLAGS.smoke, "seconds": total, "parts": results}, f, indent=2)
  if FLAGS.smoke and (problems := check_smoke(results)):
    print("smoke check failed:\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
