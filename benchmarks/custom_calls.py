"""Which fused kernels a compiled program calls: the custom calls of its optimised HLO.

The attention kernels that are not XLA's own (cuDNN's fused attention on a GPU, the Pallas
kernels on a TPU) are custom calls in the program XLA compiles, with their options in the
call's backend config. Counting them by target and cuDNN's `mask_type` says what will run: e.g.
that causal attention reaches cuDNN's causal kernel (`__cudnn$fmhaSoftmax`, mask CAUSAL, three
operands q, k, v) and not a masked one with a [B, 1, L, S] mask or bias operand
(`__cudnn$fmhaScaleBiasSoftmax`, four).

Used by `tpu_compile.py --custom_calls` on XLA's dump of the train step (`xla_dump_to`).
"""

from __future__ import annotations

import collections
import glob
import os
import re

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_MASK = re.compile(r'"mask_type":\s*"([A-Z_]+)"')
_COMMENT = re.compile(r"/\*.*?\*/")


def _operands(line: str) -> int:
  """How many operands the custom call on this HLO line takes."""
  start = line.index("custom-call(") + len("custom-call(")
  inside = _COMMENT.sub("", line[start : line.index(")", start)]).strip()
  return len(inside.split(",")) if inside else 0


def calls(hlo_text: str) -> collections.Counter:
  """(target, mask type or "", operands) -> count, over the custom calls of `hlo_text`."""
  found = collections.Counter()
  for line in hlo_text.splitlines():
    if "custom-call(" not in line or not (target := _TARGET.search(line)):
      continue
    mask = _MASK.search(line)
    found[(target.group(1), mask.group(1) if mask else "", _operands(line))] += 1
  return found


def hlo_of(dump_dir: str) -> str:
  """The optimised HLO text of the train step XLA dumped into `dump_dir`."""
  paths = sorted(glob.glob(os.path.join(dump_dir, "*train_step*after_optimizations.txt")))
  if not paths:
    raise FileNotFoundError(f"XLA wrote no optimised HLO for the train step in {dump_dir}")
  with open(paths[-1]) as f:
    return f.read()


def table(dump_dir: str) -> str:
  """A markdown table of the train step's custom calls, most frequent first."""
  lines = ["| custom call | mask | operands | calls |", "|---|---|---|---|"]
  for (target, mask, operands), n in calls(hlo_of(dump_dir)).most_common():
    lines.append(f"| {target} | {mask or '-'} | {operands} | {n} |")
  if len(lines) == 2:
    lines.append("| (none: XLA's own kernels only) | | | |")
  return "\n".join(lines)
