"""Splitting an opaque kernel call (a Pallas or FFI call, which XLA's partitioner cannot split)
over the current mesh with shard_map: the batch over the data and fsdp axes, the heads over the
tensor axis."""

from __future__ import annotations

import math

import jax


def mesh_specs(B: int, G: int):
  """(batch axes, head axis) of the current mesh the kernel call is split over: the batch over
  the mesh's data and fsdp axes, the heads over its tensor axis when the key/value heads divide
  evenly. None without a mesh of more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
  if B % math.prod(sizes[a] for a in batch):
    batch = ()
  heads = "tensor" if sizes.get("tensor", 1) > 1 and G % sizes["tensor"] == 0 else None
  return (batch or None), heads


def shard(fn, specs, args_specs):
  """`fn(*args)` split over the current mesh by `args_specs` ((array, logical dims), ...), each
  dim "B" (batch), "H" (heads) or None, and `specs` (`mesh_specs`; None: not split). The
  output is [B, L, H, W]."""
  if specs is None:
    return fn(*(a for a, _ in args_specs))
  batch, heads = specs
  P = jax.sharding.PartitionSpec
  to_axes = {"B": batch, "H": heads, None: None}
  in_specs = tuple(P(*(to_axes[d] for d in dims)) for _, dims in args_specs)
  out_spec = P(batch, None, heads, None)
  mapped = jax.shard_map(fn, in_specs=in_specs, out_specs=out_spec, check_vma=False)
  return mapped(*(a for a, _ in args_specs))
