"""Where a compiled program's memory goes: XLA's buffer assignment, summed by array shape.

XLA writes a memory usage report beside the HLO it dumps (`xla_dump_to`): one line per
allocation (a block of device memory at one offset) with the values that share it over the
program's run. `by_shape` sums the allocations by the largest value each holds, which is how
the fused kernels' memory was traced to their residuals (docs/tpu.md#memory-of-the-fused-kernels):
a residual kept for the backward pass shows up as a shape repeated once per layer.

Used by `tpu_compile.py --memory_report=N`; works for any backend that writes the report (TPU,
CPU). The report's total is XLA's heap simulation of temporaries, which can differ from
`memory_analysis()`'s temporaries (the table's figure).
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re

# One allocation: "cumulative(pct%); size; offset; n_values; shapes". Sizes as XLA prints them.
_LINE = re.compile(r"^\s*\S+\(\s*\d+%\);\s*([\d.]+)(B|KiB|MiB|GiB);\s*\d+;\s*\d+;\s*(.*)$")
_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SHAPE = re.compile(r"^(?:\d+×)?(([a-z]+\d*)\[([\d,]*)\])")  # "5×f32[64,512]": f32[64,512]
_BITS = re.compile(r"(\d+)$")


def _value_bytes(dtype: str, dims: str) -> int:
  """Bytes of an array of `dtype` (f32, bf16, s8, pred, ...) and comma-separated `dims`."""
  bits = int(m.group(1)) if (m := _BITS.search(dtype)) else 8  # pred: one byte
  return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def allocations(report_path: str) -> list[tuple[int, str]]:
  """(bytes, largest value's shape) of each allocation in an XLA memory usage report."""
  rows = []
  with open(report_path) as f:
    for line in f:
      if not (m := _LINE.match(line)):
        continue
      size = round(float(m.group(1)) * _UNIT[m.group(2)])
      values = [s for v in m.group(3).split(", ") if (s := _SHAPE.match(v))]
      largest = max(values, key=lambda s: _value_bytes(s.group(2), s.group(3)), default=None)
      rows.append((size, largest.group(1) if largest else "?"))
  return rows


def by_shape(report_path: str, top: int) -> list[tuple[str, int, int]]:
  """The `top` shapes holding the most memory: (shape, allocations, bytes), largest first."""
  count, total = collections.Counter(), collections.Counter()
  for size, shape in allocations(report_path):
    count[shape] += 1
    total[shape] += size
  return [(shape, count[shape], nbytes) for shape, nbytes in total.most_common(top)]


def report_of(dump_dir: str) -> str:
  """The memory usage report of the train step XLA dumped into `dump_dir`."""
  paths = sorted(glob.glob(os.path.join(dump_dir, "*train_step*memory-usage-report.txt")))
  if not paths:
    raise FileNotFoundError(f"XLA wrote no memory usage report for the train step in {dump_dir}")
  return paths[-1]


def table(dump_dir: str, top: int) -> str:
  """A markdown table of `by_shape` for the train step dumped into `dump_dir`."""
  lines = ["| shape (largest value of each allocation) | allocations | MiB |", "|---|---|---|"]
  for shape, n, nbytes in by_shape(report_of(dump_dir), top):
    lines.append(f"| {shape} | {n} | {nbytes / (1 << 20):.1f} |")
  return "\n".join(lines)
