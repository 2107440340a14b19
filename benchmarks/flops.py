"""FLOPs per token of a run config's train step and the peaks MFU divides by (throughput.py,
gpu_check.py): no flags, so any benchmark imports it."""

import statistics
import time


def flops_per_token(run_config, *, head_fraction: float = 1.0) -> float:
  """6 x matmul parameters + 12 x layers x L x H x K (PaLM), the output layer at a fraction of L.

  head_fraction 1 gives the model's nominal FLOPs; the encoder's train step runs its output
  layer at max_predictions of the L positions (XLA's cost analysis cannot tell: it counts both
  branches of the step's lax.cond).
  """
  from roformer.nn import config as nn_config

  m = run_config.model
  D, F, V = m.emb_dim, m.mlp_dim, m.vocab_size
  E = m.embedding_size or D
  H, G, K = m.num_heads, nn_config.resolve_num_kv_heads(m), nn_config.resolve_head_dim(m)
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


# Dense bfloat16 matmul peak per device (a v4 / v5p chip in megacore mode is one device), from
# the vendors' datasheets: the denominator of MFU on accelerators, where a measured matmul falls
# short of the chip.
CHIP_PEAK_BF16 = {
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,
  "TPU v5": 459e12,
  "TPU v6 lite": 918e12,
  "NVIDIA A100-SXM4-40GB": 312e12,
  "NVIDIA A100-SXM4-80GB": 312e12,
  "NVIDIA H100 80GB HBM3": 989e12,
  "NVIDIA H100 PCIe": 756e12,
  "NVIDIA H200": 989e12,
}


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
