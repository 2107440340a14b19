"""NVIDIA GPUs described for XLA, so that a program compiles for them on a machine without one.

JAX's CUDA plugin compiles for a GPU it is given a description of (`target_config`: the device
properties XLA's GPU compiler asks the driver for) instead of one it finds; no driver, no device.
`devices("h100:2x8")` are the compile-only devices of 2 hosts with 8 H100s each, for
`jit(...).lower(...).compile()` (tpu_compile.py). What the compile cannot do without the device:
autotune (it picks kernels and tilings by its heuristics), so a compile here is quicker than the
same compile on the GPU, and the program's speed is not measured.

Needs the CUDA plugin and cuDNN (to plan cuDNN's fused attention), about 650 MB of wheels; the
NVIDIA libraries the plugin runs with on a GPU are not needed:

  pip install -c requirements.txt "jax-cuda13-plugin==0.10.2" "nvidia-cudnn-cu13==9.28.1.4"
"""

from __future__ import annotations

import re

MIB = 1 << 20

# Per GPU: the device properties XLA reads (CUDA's cudaDeviceProp and the SXM datasheets):
# streaming multiprocessors, FP32 lanes per SM, shared memory per SM and the most one block
# may opt into, L2 bytes, memory bandwidth (bytes/s), boost clock, device memory (nvidia-smi's
# total), compute capability. Every GPU here has 1,024 threads a block, 2,048 threads and 64 Ki
# registers an SM.
GPUS = {
  "a100": dict(name="NVIDIA A100-SXM4-80GB", sms=108, fp32_per_sm=64, smem_per_sm=164 * 1024,
               smem_per_block_optin=163 * 1024, l2=40 * MIB, bandwidth=2_039e9, clock_ghz=1.41,
               memory=81_920 * MIB, capability=(8, 0)),
  "h100": dict(name="NVIDIA H100 80GB HBM3", sms=132, fp32_per_sm=128, smem_per_sm=228 * 1024,
               smem_per_block_optin=227 * 1024, l2=50 * MIB, bandwidth=3_352e9, clock_ghz=1.98,
               memory=81_559 * MIB, capability=(9, 0)),
  "h200": dict(name="NVIDIA H200", sms=132, fp32_per_sm=128, smem_per_sm=228 * 1024,
               smem_per_block_optin=227 * 1024, l2=50 * MIB, bandwidth=4_800e9, clock_ghz=1.98,
               memory=143_771 * MIB, capability=(9, 0)),
}  # fmt: skip

_SPEC = re.compile(r"^([a-z0-9]+)(?::(?:(\d+)x)?(\d+))?$")
INSTALL = (
  'pip install -c requirements.txt "jax-cuda13-plugin==0.10.2" "nvidia-cudnn-cu13==9.28.1.4"'
)


def parse(spec: str) -> tuple[str, int, int] | None:
  """("h100", hosts, GPUs a host) of "h100", "h100:8" or "h100:2x8"; None when `spec` names no
  GPU of `GPUS` (a TPU topology, say)."""
  m = _SPEC.match(spec.lower())
  if m is None or m.group(1) not in GPUS:
    return None
  return m.group(1), int(m.group(2) or 1), int(m.group(3) or 1)


def target_config(gpu: str, cudnn: tuple[int, int], cuda: tuple[int, int]) -> str:
  """XLA's GpuTargetConfig (text proto) for `gpu`, with the cuDNN and CUDA versions compiled for."""
  g = GPUS[gpu]
  return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g["smem_per_sm"]}
  threads_per_core_limit: 2048
  core_count: {g["sms"]}
  fpus_per_core: {g["fp32_per_sm"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g["bandwidth"])}
  l2_cache_size: {g["l2"]}
  clock_rate_ghz: {g["clock_ghz"]}
  device_memory_size: {g["memory"]}
  shared_memory_per_block_optin: {g["smem_per_block_optin"]}
  cuda_compute_capability {{ major: {g["capability"][0]} minor: {g["capability"][1]} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}
runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}
device_description_str: "{g["name"]}"
"""


def _versions() -> tuple[tuple[int, int], tuple[int, int]]:
  """(cuDNN, CUDA runtime) (major, minor) the installed plugin compiles with."""
  from jax._src.lib import cuda_versions

  if cuda_versions is None:
    raise RuntimeError(f"the JAX CUDA plugin is not installed: {INSTALL}")
  try:
    cudnn = cuda_versions.cudnn_get_version()  # 92801: 9.28.1
  except RuntimeError as e:
    raise RuntimeError(f"cuDNN is not installed ({e}): {INSTALL}") from e
  cuda = cuda_versions.cuda_runtime_build_version()  # 13000: 13.0
  return (cudnn // 10000, cudnn // 100 % 100), (cuda // 1000, cuda // 10 % 100)


def devices(spec: str):
  """Compile-only devices of `spec` ("h100", "h100:8", "h100:2x8": hosts x GPUs a host)."""
  from jax.experimental import topologies

  parsed = parse(spec)
  if parsed is None:
    raise ValueError(f"{spec!r} names no GPU; known: {', '.join(GPUS)} (e.g. h100:8, h100:2x8)")
  gpu, hosts, per_host = parsed
  config = target_config(gpu, *_versions())
  return topologies.get_topology_desc(
    platform="cuda", target_config=config, topology=f"1x{hosts}x{per_host}"
  ).devices


def memory_bytes(device_kind: str) -> int:
  """Device memory of the GPU named `device_kind` (a device's), 0 when not in `GPUS`."""
  return next((g["memory"] for g in GPUS.values() if g["name"] == device_kind), 0)
