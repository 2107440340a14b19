"""Where the train step's time goes: XLA's per-op times on CPU, split into forward, backward and
the optimizer update.

Runs the real train step (bench_step.JaxTrainer, jitted as train.py jits it) under the JAX
profiler and reads the trace back (jax.profiler.ProfileData): every op XLA:CPU executed, with its
duration, matched to its HLO instruction in the compiled step. The instruction's metadata names
the JAX operation it came from (`jit(train_step)/transpose(jvp(BLD,DHK->BLHK))/dot_general`):
`transpose(...)` marks the backward pass, `jvp(...)` the forward pass, the rest is the loss
bookkeeping and the optimizer update. Ops run on several threads at once, so the op times add up
to more than the wall time of a step; the shares are of their sum.

  JAX_PLATFORMS=cpu python -m benchmarks.profile_step --config=configs/lm.py \
    --config.model.num_layers=4 --config.model.emb_dim=256 --config.model.num_heads=4 \
    --config.model.mlp_dim=704 --config.model.activation=swiglu --config.model.norm=rmsnorm \
    --config.model.use_bias=False --config.model.tie_embeddings=False \
    --config.model.dropout_rate=0 --config.data.seq_len=512 --config.train.global_batch_size=8
  JAX_PLATFORMS=cpu python -m benchmarks.profile_step --smoke   # seconds; what the test runs

Prints three tables (by phase, by operation, the slowest instructions) and optionally writes
them as JSON. With --torch, the Hugging Face model of the same shape (hf_counterpart.py: Llama,
GPT-NeoX or RoFormer) is profiled after it with torch.profiler: the wall time of its labelled
forward, backward and update, and each ATen op's self time. Run it on an otherwise idle machine.
"""

import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

from benchmarks import bench_step, hf_counterpart

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

config_flags.DEFINE_config_file(
  "config", os.path.join(_REPO, "configs", "lm.py"), "Training config file.", lock_config=True
)
flags.DEFINE_integer("steps", 5, "Profiled train steps.")
flags.DEFINE_integer("warmup", 2, "Unprofiled steps after compiling.")
flags.DEFINE_integer("top", 25, "Rows of the slowest-instruction table.")
flags.DEFINE_bool(
  "torch", False, "Also profile the Hugging Face counterpart in PyTorch (hf_counterpart.py)."
)
flags.DEFINE_bool("smoke", False, "Tiny model and a few steps (a test runs this).")
flags.DEFINE_string("json", "", "Write the tables to this JSON file.")
FLAGS = flags.FLAGS

SMOKE = bench_step.SMOKE_MODEL
# `%name = shape opcode(...)... metadata={op_name="..."`: one HLO instruction.
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*?)metadata=\{op_name=\"([^\"]*)\""
)
# Profiler events on the XLA threads that are bookkeeping, not ops.
_NOT_OPS = ("ThreadpoolListener", "ThunkExecutor", "end: ")
_PHASES = ("forward", "backward", "update")
# Control flow whose nested ops are profiled as events of their own.
_CONTAINERS = ("conditional", "while", "call")


def instructions(hlo_text: str) -> dict[str, dict]:
  """HLO instruction name -> {opcode, shape, op_name} of every instruction with metadata."""
  table = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      name, shape, opcode, _, op_name = m.groups()
      table[name] = {"opcode": opcode, "shape": shape.split("{")[0], "op_name": op_name}
  return table


def phase(op_name: str) -> str:
  """backward (a transpose of the linearised step), forward (a JVP) or update (the rest)."""
  if "transpose(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  return "update"


def operation(op_name: str) -> str:
  """The JAX primitive, with its einsum spec when it has one: `dot_general ...D,DHK->...HK`."""
  leaf = op_name.rsplit("/", 1)[-1]
  spec = re.findall(r"\(([\w.]+,[\w.]+->[\w.]+)\)", op_name)
  return f"{leaf} {spec[-1]}" if spec and leaf == "dot_general" else leaf


def op_events(trace_dir: str) -> list[tuple[str, float]]:
  """(op name, seconds) of every op executed on XLA:CPU's threads in the trace."""
  from jax.profiler import ProfileData

  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
  events = []
  for plane in ProfileData.from_file(paths[-1]).planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for event in line.events:
        if not event.name.startswith(_NOT_OPS):
          events.append((event.name, event.duration_ns * 1e-9))
  return events


def profile(run_config, *, steps: int, warmup: int) -> dict:
  """Profiles `steps` train steps; returns the tables (seconds per step)."""
  import jax

  trainer = bench_step.JaxTrainer(run_config)
  trainer.run(warmup)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    trainer.run(steps)
    wall = (time.perf_counter() - start) / steps
    jax.profiler.stop_trace()
    events = op_events(trace_dir)
  table = instructions(trainer.compiled.as_text())
  by_phase, by_op, by_instruction = (collections.Counter() for _ in range(3))
  unmatched = collections.Counter()
  for name, seconds in events:
    info = table.get(name)
    if info is not None and info["opcode"] in _CONTAINERS:
      continue  # its branch or body ops are events of their own
    if info is None:  # e.g. copies and tuple bookkeeping without metadata
      unmatched[name] += seconds / steps
      by_phase["other"] += seconds / steps
      continue
    by_phase[phase(info["op_name"])] += seconds / steps
    by_op[(phase(info["op_name"]), operation(info["op_name"]))] += seconds / steps
    by_instruction[name] += seconds / steps
  total = sum(by_phase.values())
  return {
    "wall_seconds_per_step": wall,
    "op_seconds_per_step": total,
    "tokens_per_sec": run_config.train.global_batch_size * run_config.data.seq_len / wall,
    "phases": dict(by_phase.most_common()),
    "operations": [{"phase": p, "operation": o, "seconds": s} for (p, o), s in by_op.most_common()],
    "other": dict(unmatched.most_common(10)),
    "instructions": [
      {"name": n, "seconds": s, **table[n]} for n, s in by_instruction.most_common()
    ],
  }


def profile_torch(run_config, *, steps: int, warmup: int) -> dict:
  """Profiles the Hugging Face counterpart's train step with torch.profiler (seconds per step).

  Phases are the wall time of the step's labelled forward, backward and update; operations are
  each ATen op's self time on the calling thread (its intra-op threads work inside it).
  """
  from torch.profiler import ProfilerActivity, record_function
  from torch.profiler import profile as torch_profile

  trainer = hf_counterpart.TorchTrainer(run_config, hf_counterpart.hf_counterpart(run_config))
  trainer.run(warmup)
  with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
    start = time.perf_counter()
    for _ in range(steps):
      trainer.step(record_function)
    wall = (time.perf_counter() - start) / steps
  averages = prof.key_averages()
  phases = {e.key: e.cpu_time_total * 1e-6 / steps for e in averages if e.key in _PHASES}
  ops = sorted(
    (e for e in averages if e.key not in _PHASES and e.self_cpu_time_total > 0),
    key=lambda e: -e.self_cpu_time_total,
  )
  return {
    "model": trainer.name,
    "wall_seconds_per_step": wall,
    "op_seconds_per_step": sum(e.self_cpu_time_total for e in ops) * 1e-6 / steps,
    "tokens_per_sec": run_config.train.global_batch_size * run_config.data.seq_len / wall,
    "phases": {name: phases.get(name, 0.0) for name in _PHASES},
    "operations": [
      {
        "operation": e.key,
        "calls": e.count // steps,
        "seconds": e.self_cpu_time_total * 1e-6 / steps,
      }
      for e in ops
    ],
  }


def print_torch_tables(result: dict, top: int) -> None:
  total = result["op_seconds_per_step"]
  ms = lambda s: f"{1e3 * s:,.2f}"  # noqa: E731
  print(
    f"\n{result['model']} (PyTorch): wall {ms(result['wall_seconds_per_step'])} ms/step "
    f"({result['tokens_per_sec']:,.0f} tokens/s)\n"
  )
  print("| phase | ms/step (wall) |\n|---|---|")
  for name, s in result["phases"].items():
    print(f"| {name} | {ms(s)} |")
  print("\n| ATen op | calls/step | ms/step (self) | share |\n|---|---|---|---|")
  for row in result["operations"][:top]:
    s = row["seconds"]
    print(f"| {row['operation']} | {row['calls']} | {ms(s)} | {100 * s / total:.1f}% |")


def print_tables(result: dict, top: int) -> None:
  total = result["op_seconds_per_step"]
  ms = lambda s: f"{1e3 * s:,.2f}"  # noqa: E731
  pct = lambda s: f"{100 * s / total:.1f}%"  # noqa: E731
  print(
    f"\nwall {ms(result['wall_seconds_per_step'])} ms/step "
    f"({result['tokens_per_sec']:,.0f} tokens/s); op time {ms(total)} ms/step over all threads\n"
  )
  print("| phase | ms/step | share |\n|---|---|---|")
  for name, s in result["phases"].items():
    print(f"| {name} | {ms(s)} | {pct(s)} |")
  print("\n| phase | operation | ms/step | share |\n|---|---|---|---|")
  for row in result["operations"][:top]:
    s = row["seconds"]
    print(f"| {row['phase']} | {row['operation']} | {ms(s)} | {pct(s)} |")
  print("\n| instruction | opcode | shape | from | ms/step | share |\n|---|---|---|---|---|---|")
  for row in result["instructions"][:top]:
    s = row["seconds"]
    source = row["op_name"].removeprefix("jit(train_step)/")
    print(f"| {row['name']} | {row['opcode']} | {row['shape']} | {source} | {ms(s)} | {pct(s)} |")


def main(argv):
  del argv
  from roformer.infra import cpu_flags

  # As train.py does, before JAX starts; with --torch glibc's malloc keeps its defaults, since
  # PyTorch is profiled in the same process (roformer.infra.cpu_flags.keep_freed_host_memory).
  cpu_flags.set_default_cpu_flags(keep_freed_memory=not FLAGS.torch)
  config = FLAGS.config
  if FLAGS.smoke:
    bench_step.apply_overrides(config, SMOKE)
  run_config = bench_step.run_config(config)
  if FLAGS.torch and (missing := hf_counterpart.missing()):
    sys.exit(f"profile_step.py: error: {missing}")
  result = profile(run_config, steps=FLAGS.steps, warmup=FLAGS.warmup)
  print_tables(result, FLAGS.top)
  if FLAGS.torch:
    result["torch"] = profile_torch(run_config, steps=FLAGS.steps, warmup=FLAGS.warmup)
    print_torch_tables(result["torch"], FLAGS.top)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
