"""Peak memory of long-context evaluation: one child process per length, batch 1.

Evaluates a randomly initialised 4-layer, 256-wide RoPE decoder with evals.perplexity at each length
and prints peak resident memory (ru_maxrss of the child), its ratio to the shortest length, the XLA
temporary buffers of the compiled scoring step and the wall time. Blockwise evaluation keeps
activations O(L * D), so 32k tokens should stay well under 2x the 2k figure.

  JAX_PLATFORMS=cpu python -m benchmarks.eval_memory [--lengths=2048,8192,32768]
"""

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from benchmarks import bench_step

flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Context lengths, one process each.")
flags.DEFINE_integer("child", 0, "Internal: evaluate this one length and print JSON.")
flags.DEFINE_integer("num_layers", 4, "Decoder layers.")
flags.DEFINE_integer("emb_dim", 256, "Model width D.")
flags.DEFINE_integer("attention_block", 512, "Query/key block and sequence block.")
FLAGS = flags.FLAGS


def _child(length: int) -> dict:
  """Evaluates one window of `length` tokens; returns timings and XLA memory figures."""
  import jax
  import numpy as np
  from flax import nnx

  from roformer import data
  from roformer.evals import perplexity
  from roformer.nn.config import ModelConfig
  from roformer.nn.model import make_model

  cfg = ModelConfig(
    kind="decoder",
    vocab_size=259,
    num_layers=FLAGS.num_layers,
    emb_dim=FLAGS.emb_dim,
    num_heads=4,
    mlp_dim=4 * FLAGS.emb_dim,
    attention_impl="auto",
    attention_block=FLAGS.attention_block,
  )
  model = make_model(cfg, rngs=nnx.Rngs(0))
  # A prefix of `length` tokens, then `length` scored targets: exactly one window.
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 2 * length + 1).astype(np.int32)
  window_args = dict(
    length=length,
    protocol="nonoverlapping",
    stride=length,
    max_tokens=length,
    max_length=length,
  )
  windows = data.eval_windows(tokens, **window_args)
  graphdef, state = nnx.split(model)
  compiled = perplexity.score_batch.lower(
    graphdef,
    state,
    windows.inputs,
    windows.targets,
    windows.positions,
    windows.weights,
    block=perplexity.loss_block_size(model, length),
  ).compile()
  analysis = compiled.memory_analysis()
  temp_mb = analysis.temp_size_in_bytes / 2**20 if analysis is not None else float("nan")
  start = time.perf_counter()
  result = perplexity.evaluate_at_length(model, tokens, **window_args, batch_size=1)
  seconds = time.perf_counter() - start
  jax.block_until_ready(state)
  return {"length": length, "loss": result["loss"], "seconds": seconds, "xla_temp_mb": temp_mb}


def _run_child(length: int) -> dict:
  """Runs `_child(length)` in a fresh process; adds its peak RSS from the kernel's rusage."""
  cmd = [sys.executable, "-m", "benchmarks.eval_memory", f"--child={length}"]
  cmd += [f"--num_layers={FLAGS.num_layers}", f"--emb_dim={FLAGS.emb_dim}"]
  cmd += [f"--attention_block={FLAGS.attention_block}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=bench_step.child_env(), text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode != 0:
    raise RuntimeError(f"length {length}: child exited with {proc.returncode}")
  record = json.loads(out.strip().splitlines()[-1])
  record["peak_rss_mb"] = usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux
  return record


def main(argv):
  del argv
  if FLAGS.child:
    print(json.dumps(_child(FLAGS.child)), flush=True)
    return
  lengths = [int(x) for x in FLAGS.lengths]
  print(
    f"decoder: {FLAGS.num_layers} layers, emb_dim {FLAGS.emb_dim}, rope, batch 1, "
    f"attention_block {FLAGS.attention_block}"
  )
  print(f"{'length':>8} {'peak RSS MB':>12} {'ratio':>7} {'XLA temp MB':>12} {'seconds':>9}")
  base = None
  for length in lengths:
    r = _run_child(length)
    base = base or r["peak_rss_mb"]
    print(
      f"{length:>8} {r['peak_rss_mb']:>12.0f} {r['peak_rss_mb'] / base:>7.2f} "
      f"{r['xla_temp_mb']:>12.1f} {r['seconds']:>9.1f}",
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)
