"""Ahead-of-time compile of the real train step for a Cloud TPU slice or NVIDIA GPUs, on any
machine.

libtpu describes the devices of a (multi-host) TPU slice without a TPU, and JAX's CUDA plugin
those of GPUs it is told the properties of (benchmarks/gpu_targets.py) without a GPU; the train
step is then jitted exactly as train.py jits it (same mesh, logical-axis rules, shardings and
donation), lowered on abstract arrays and compiled for those devices. Prints the per-device
memory XLA plans (arguments, temporaries, outputs not aliased to arguments, total) against the
device's memory and exits non-zero when it does not fit. This is how MaxText's
train_compile.py checks pod configs. A GPU compile here does not autotune (its compile time is
a lower bound of the GPU's) and measures no speed.

  pip install -c requirements.txt "jax[tpu]==0.10.2"   # brings libtpu
  python -m benchmarks.tpu_compile --config=configs/lm.py --topology=v4:2x2x4 \
    [--config.mesh.data=... --config.mesh.fsdp=... --config.mesh.tensor=... --config.*=...]
  pip install -c requirements.txt "jax-cuda13-plugin==0.10.2" "nvidia-cudnn-cu13==9.28.1.4"
  python -m benchmarks.tpu_compile --config=configs/lm.py --topology=h100:8 [--config.*=...]

`--kernels=chunked,splash,flash_bias` compiles the step once per attention kernel
(model.attention_impl) and prints one row each: compile time and per-device memory, or the one
line a kernel refuses the config with. `--memory_report=N` adds, per compile, the N array shapes
holding the most memory in XLA's buffer assignment (a residual kept for the backward pass
shows up as a shape repeated once per layer). `--custom_calls` lists the fused kernels the
step calls (benchmarks/custom_calls.py): cuDNN's attention with its mask type, Pallas kernels.

Every --config.* override train.py takes works here. The vocabulary size is data.vocab_size (a
trained tokenizer's size) or 261 for the bytes tokenizer, so no corpus is read.
"""

import contextlib
import os
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

from benchmarks import bench_step, custom_calls, gpu_targets, memory_report

config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
flags.DEFINE_string(
  "topology",
  "v4:2x2x4",
  "TPU slice (v4:2x2x4, v5e:4x4, v5p:2x2x2) or NVIDIA GPUs: a100, h100, h200, with the GPUs "
  "of one host (h100:8) or hosts x GPUs a host (h100:2x8).",
)
flags.DEFINE_enum(
  "chip_config",
  "auto",
  ["auto", "default", "megacore"],
  "libtpu chip configuration: megacore (one device per v4/v5p chip, as JAX uses them), default "
  "(one per TensorCore); auto = megacore for v4 and v5p.",
)
flags.DEFINE_list(
  "kernels",
  [],
  "Attention kernels (model.attention_impl) to compile one after another, one table row each; "
  "empty: the config's alone.",
)
flags.DEFINE_integer(
  "memory_report",
  0,
  "Also print the N shapes holding the most device memory in XLA's buffer assignment of the "
  "step (benchmarks/memory_report.py), per kernel; 0: none.",
)
flags.DEFINE_bool(
  "custom_calls",
  False,
  "Also print the custom calls of the compiled step (benchmarks/custom_calls.py): cuDNN's fused "
  "attention with its mask type, Pallas kernels; per kernel.",
)
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS

GIB = 1024**3
# HBM per JAX device (one chip; a v4 or v5p chip in megacore mode, half of it per TensorCore).
HBM_PER_CHIP = {
  "TPU v2": 8 * GIB,
  "TPU v3": 16 * GIB,
  "TPU v4": 32 * GIB,
  "TPU v5 lite": 16 * GIB,
  "TPU v5": 95 * GIB,
  "TPU v6 lite": 32 * GIB,
}


def device_memory(device_kind: str) -> int:
  """Memory of one device of this kind (bytes), 0 when unknown."""
  return HBM_PER_CHIP.get(device_kind) or gpu_targets.memory_bytes(device_kind)


def topology_devices(topology: str, chip_config: str):
  """Compile-only devices of `topology` (a TPU slice or GPUs); raises RuntimeError with a clear
  message without libtpu or the CUDA plugin."""
  from jax.experimental import topologies

  if gpu_targets.parse(topology) is not None:
    try:
      return gpu_targets.devices(topology)
    except RuntimeError as e:
      raise RuntimeError(f"--topology={topology}: {e}") from e

  if chip_config == "auto":
    chip_config = "megacore" if topology.split(":")[0] in ("v4", "v5p") else "default"
  kwargs = {"chip_config_name": chip_config} if chip_config != "default" else {}
  try:
    return topologies.get_topology_desc(topology, "tpu", **kwargs).devices
  except Exception as e:  # no libtpu, or a topology it does not know
    raise RuntimeError(
      f"--topology={topology}: libtpu could not describe it ({str(e).splitlines()[0]}); "
      'install libtpu with `pip install -c requirements.txt "jax[tpu]==0.10.2"`'
    ) from e


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from roformer import config as config_lib

  config = FLAGS.config
  if FLAGS.kernels:
    sys.exit(compare_kernels(config, FLAGS.kernels))
  try:
    run_config = bench_step.run_config(config)
    devices = topology_devices(FLAGS.topology, FLAGS.chip_config)
    with dump_dir() as dump:
      result = bench_step.compile_train_step(run_config, devices, dump)
      report = dump and reports(dump)
  except (config_lib.ConfigError, RuntimeError, ValueError) as e:
    print(f"tpu_compile.py: error: {e}", file=sys.stderr)
    sys.exit(1)
  except bench_step.DoesNotFitError as e:
    print(
      f"tpu_compile.py: error: the train step does not fit the device memory: {e}", file=sys.stderr
    )
    sys.exit(2)
  kind = devices[0].device_kind
  hbm = device_memory(kind)
  hosts = len({d.process_index for d in devices})
  m = run_config.model
  rows = [
    ("topology", f"{FLAGS.topology}: {len(devices)} x {kind} on {hosts} hosts"),
    ("mesh", ", ".join(f"{k}={v}" for k, v in result["mesh"].items())),
    (
      "model",
      f"{m.kind} {m.num_layers}x{m.emb_dim} H{m.num_heads} F{m.mlp_dim} V{m.vocab_size} "
      f"{m.dtype}, {result['num_params'] / 1e6:.1f}M parameters",
    ),
    ("batch", f"{run_config.train.global_batch_size} x {run_config.data.seq_len} tokens"),
    ("compile (s)", f"{result['compile_seconds']:.1f}"),
    ("arguments / device (GiB)", f"{result['argument_bytes'] / GIB:.3f}"),
    ("temporaries / device (GiB)", f"{result['temp_bytes'] / GIB:.3f}"),
    ("outputs / device (GiB)", f"{result['output_bytes'] / GIB:.3f}"),
    ("total / device (GiB)", f"{result['total_bytes'] / GIB:.3f}"),
    ("HBM / device (GiB)", f"{hbm / GIB:.0f}" if hbm else "unknown"),
  ]
  fits = hbm == 0 or result["total_bytes"] <= hbm
  rows.append(("fits", "yes" if fits else "NO"))
  width = max(len(name) for name, _ in rows)
  print("\n".join(f"| {name:<{width}} | {value} |" for name, value in rows))
  if report:
    print(report)
  if not fits:
    print(
      f"tpu_compile.py: error: {result['total_bytes'] / GIB:.2f} GiB per device does not fit the "
      f"{hbm / GIB:.0f} GiB of a {kind}",
      file=sys.stderr,
    )
    sys.exit(2)


def compare_kernels(config, kernels) -> int:
  """Compiles the step with each attention kernel; prints a markdown table; returns the exit
  status (1 when a kernel outside the refusals fails, 2 when one does not fit)."""
  from roformer import config as config_lib

  devices = topology_devices(FLAGS.topology, FLAGS.chip_config)
  hbm = device_memory(devices[0].device_kind)
  print(f"{FLAGS.topology}: {len(devices)} x {devices[0].device_kind}, {hbm / GIB:.0f} GiB each")
  print("| kernel | compile (s) | arguments (GiB) | temporaries (GiB) | total (GiB) | fits |")
  print("|---|---|---|---|---|---|")
  status, tables = 0, []
  for kernel in kernels:
    variant = config.copy_and_resolve_references()
    with variant.unlocked():
      variant.model.attention_impl = kernel
    try:
      with dump_dir() as dump:
        result = bench_step.compile_train_step(bench_step.run_config(variant), devices, dump)
        if dump:
          tables.append(reports(dump, f"{kernel}: "))
    except (config_lib.ConfigError, ValueError) as e:
      print(f"| {kernel} | refused: {str(e).splitlines()[0]} | | | | |", flush=True)
      continue
    except bench_step.DoesNotFitError as e:
      print(f"| {kernel} | does not fit: {e} | | | | no |", flush=True)
      status = 2
      continue
    fits = hbm == 0 or result["total_bytes"] <= hbm
    status = status if fits else 2
    print(
      f"| {kernel} | {result['compile_seconds']:.1f} | {result['argument_bytes'] / GIB:.3f} | "
      f"{result['temp_bytes'] / GIB:.3f} | {result['total_bytes'] / GIB:.3f} | "
      f"{'yes' if fits else 'NO'} |",
      flush=True,
    )
  if tables:
    print("".join(tables))
  return status


def reports(dump: str, prefix: str = "") -> str:
  """The tables --memory_report and --custom_calls ask for, of the step XLA dumped to `dump`."""
  text = ""
  if FLAGS.memory_report:
    top = memory_report.table(dump, FLAGS.memory_report)
    text += f"\n{prefix}largest buffers by shape, per device\n{top}\n"
  if FLAGS.custom_calls:
    text += f"\n{prefix}custom calls\n{custom_calls.table(dump)}\n"
  return text


@contextlib.contextmanager
def dump_dir():
  """A temporary directory for XLA's dump when --memory_report or --custom_calls asks for one,
  else None."""
  if not (FLAGS.memory_report or FLAGS.custom_calls):
    yield None
    return
  with tempfile.TemporaryDirectory(prefix="tpu_compile_") as path:
    yield path


if __name__ == "__main__":
  # libtpu reads these to find the slice of the machine it runs on; compiling for a described
  # topology needs none of them, so keep its start-up quiet and local.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # No TPU is opened, so several compiles may share the machine (libtpu otherwise holds a
  # machine-wide lockfile and refuses a second process).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # Compiling for described devices needs none of this machine's accelerators: the CPU backend
  # alone, so that a CUDA plugin installed on a machine without a GPU (to compile for one) does
  # not try to open one, which would leave it unable to describe GPUs. (jax is imported by now,
  # so the setting goes to its config, read when the first backend starts.)
  if "JAX_PLATFORMS" not in os.environ:
    import jax

    jax.config.update("jax_platforms", "cpu")
  app.run(main)
