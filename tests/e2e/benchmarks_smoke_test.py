"""CI-sized runs of the table-printing benchmarks: each finishes and prints a row per case."""

import os
import re
import subprocess
import sys

import pytest

from roformer.testing import REPO

# (script, arguments, regular expressions of the table rows it must print)
CASES = {
  "data": (
    ["--steps=3", "--seq_len=64", "--global_batch_size=4", "--tokenizers=bytes"],
    [r"^\| bytes \| decoder \| [\d,]+ \|", r"^\| bytes \| encoder \| [\d,]+ \|"],
  ),
  "cpu_attention": (
    ["--smoke"],  # 2 x 64 tokens: the fused kernel and the XLA kernels, forward and backward
    [
      r"^\| 64 \| cpu_flash \| [\d.,]+ \| [\d.,]+ \|",
      r"^\| 64 \| XLA kernels \| [\d.,]+ \| [\d.,]+ \|",
    ],
  ),
  "eval_speed": (
    ["--smoke"],  # 1 layer x 32 at 64 and 256 tokens: one dense, one chunked
    [r"^\| 64 \| [\d,]+ \| [\d.]+ \| - \| - \|", r"^\| 256 \| [\d,]+ \| [\d.]+ \| - \| - \|"],
  ),
  "frontier": (
    ["--smoke", "--only=qk_norm,fox"],  # plain RoPE and two arms, one step each
    [
      r"^\| rope \| [\d,]+ \| 1\.00 \|",
      r"^\| qk_norm \| [\d,]+ \| [\d.]+ \|",
      r"^\| fox \| [\d,]+ \| [\d.]+ \|",
    ],
  ),  # fmt: skip
  "bias_factor_precision": (
    ["--lengths=2048", "--heads=4", "--head_dim=16", "--sandwich_dim=32"],
    [  # ALiBi's m j reaches 512: one bfloat16 piece is off by whole units, three are not
      r"^\| alibi \| float32 \| 2048 \| 512 \| 0\.0e\+00 \| \d\.\de-0[5-9] \|  \|",
      r"^\| alibi \| bfloat16 \| 2048 \| 512 \| \d\.\de-03 \| \d\.\de-03 \| \d\.\de[-+]0[01] \|",
      r"^\| sandwich \| bfloat16 \| 2048 \|  \|",
      r"^\| fox \| float32 \| 2048 \| \d+ \|",
    ],
  ),  # fmt: skip
  "eval_memory": (
    ["--lengths=128,256", "--num_layers=1", "--emb_dim=32", "--attention_block=64"],
    [r"^\s+128\s+\d+", r"^\s+256\s+\d+"],
  ),
  "window": (
    ["--lengths=256,512", "--window=64", "--block=64", "--full_max=256", "--repeats=1"],
    [r"^\| 256 \| [\d.]+ \|", r"^\| 512 \| [\d.]+ \|"],
  ),
  "profile_step": (
    ["--smoke", "--steps=2", "--warmup=1", "--top=80"],
    [
      r"^\| forward \| [\d.,]+ \| [\d.]+% \|",
      r"^\| backward \| [\d.,]+ \| [\d.]+% \|",
      r"^\| update \| [\d.,]+ \| [\d.]+% \|",
      r"^\| backward \| dot_general \.\.\.HK,HKD->\.\.\.D \|",  # einsum specs name the matmuls
      r"^\| [\w.\-]+ \| dot \| f32\[",
    ],
  ),
  "train_memory": (
    ["--smoke", "--lengths=64", "--remat_length=128", "--deep_layers=2", "--steps=1"],
    [
      r"^\| 64 \| dense \| [\d.]+ \|",
      r"^\| 64 \| chunked \| [\d.]+ \|",
      r"^\| 128 \| auto \| True \| full \| \d+ \|",
      r"^\| 2 \| True \| [\d.]+ \|",
    ],
  ),
}


@pytest.mark.slow  # about a minute each on a loaded 2-core machine
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_smoke_run_prints_its_table(script):
  args, expected = CASES[script]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-m", f"benchmarks.{script}", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  for pattern in expected:
    assert re.search(pattern, proc.stdout, re.MULTILINE), (pattern, proc.stdout[-2000:])


def test_checkpoint_digest_times_the_save_the_manifest_and_a_restore(tmp_path):
  # In-process: the table's rows are its measure(); the smoke model's state.
  from benchmarks import checkpoint_digest

  _, (model_state, opt_state), (model_abs, opt_abs) = checkpoint_digest._train_state(smoke=True)
  size, files, rows = checkpoint_digest.measure(
    tmp_path, model_state, opt_state, model_abs, opt_abs, repeats=1
  )
  assert [name for name, _ in rows] == [
    "save, manifest included",
    "manifest written",
    "manifest checked",
    "restore (no check)",
  ]
  assert size > 0 and files > 10 and all(seconds > 0 for _, seconds in rows)
