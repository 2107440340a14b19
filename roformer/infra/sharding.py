"""The device mesh, logical-axis rules and shardings: the only place a mesh is built.

Parameters carry logical names ('vocab', 'embed', 'heads', 'kv', 'mlp'); `mesh.rules` maps them (and
'batch') to the mesh axes ('data', 'fsdp', 'tensor').
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from roformer.errors import ConfigError
from roformer.fields import param

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = param(-1, "Data-parallel axis size (-1 = all remaining devices).")
  fsdp: int = param(
    1, "Fully-sharded data-parallel axis size: batch and parameters are split over it."
  )
  tensor: int = param(1, "Tensor-parallel axis size: heads, MLP and vocabulary are split over it.")
  rules: tuple = param(
    (
      ("batch", ("data", "fsdp")),
      ("embed", "fsdp"),
      ("mlp", "tensor"),
      ("heads", "tensor"),
      ("kv", None),
      ("vocab", "tensor"),
    ),
    "Logical axis -> mesh axes rules (first match wins), each (logical axis, mesh axis | tuple "
    "of mesh axes | None). The default shards the batch over data x fsdp and splits parameters "
    "over fsdp on their model dimension and over tensor on heads / mlp / vocabulary.",
  )


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Sizes of (data, fsdp, tensor) for `num_devices`, -1 taking the remaining devices.

  Raises:
    ConfigError: the sizes do not multiply to the number of devices.
  """
  sizes = [getattr(mesh_cfg, name) for name in MESH_AXES]
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise ConfigError(
        f"mesh: {num_devices} devices cannot be split with "
        + ", ".join(f"mesh.{n}={s}" for n, s in zip(MESH_AXES, sizes, strict=True))
      )
    sizes[sizes.index(-1)] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ConfigError(
      f"mesh.data * mesh.fsdp * mesh.tensor = {math.prod(sizes)} but there are {num_devices} "
      "devices; set one of them to -1 to take the remaining devices"
    )
  return tuple(sizes)


def make_mesh(mesh_cfg: MeshConfig, devices: list | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all devices (of every process) or `devices`."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_cfg, len(devices))
  # Auto axes: sharding follows the logical-rule annotations; Explicit axes break them.
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
  )


def axis_rules(mesh_cfg: MeshConfig) -> tuple:
  """mesh.rules in the form nnx.logical_axis_rules takes."""
  return tuple(mesh_cfg.rules)


def logical_spec(logical_axes: tuple, rules: tuple) -> P:
  """PartitionSpec of an array whose dimensions have the given logical names (None = replicated).

  A mesh axis already used by an earlier dimension is not used again (the first rule wins).
  """
  used: set[str] = set()
  spec = []
  for name in logical_axes:
    axes = None
    for logical, mesh_axes in rules:
      if logical != name or name is None:
        continue
      candidate = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
      if mesh_axes is None or not used.intersection(candidate):
        axes = mesh_axes
        break
    if axes is not None:
      used.update(axes if isinstance(axes, tuple) else (axes,))
    spec.append(axes)
  return P(*spec)


@functools.cache
def batch_sharding(mesh: Mesh, rules: tuple, ndim: int = 2) -> NamedSharding:
  """Sharding of a [B, ...] batch: B over the mesh axes of the 'batch' rule, the rest replicated.

  Cached: `put_batch` asks for it every training step.
  """
  return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_axis_size(mesh: Mesh, rules: tuple) -> int:
  """Number of ways the batch dimension is split."""
  spec = logical_spec(("batch",), rules)[0]
  axes = () if spec is None else spec if isinstance(spec, tuple) else (spec,)
  return math.prod(mesh.shape[a] for a in axes)


def process_batch_slice(mesh: Mesh, rules: tuple, global_batch_size: int) -> tuple[int, int]:
  """Which contiguous block of global batch rows this process feeds: (index, count).

  Every process feeds the rows its devices hold; processes whose devices hold the same rows (the
  batch is replicated over a mesh axis that spans processes) read the same block.

  Returns:
    (index, count): this process feeds rows [index * B / count, (index + 1) * B / count).
  """
  sharding = batch_sharding(mesh, rules, ndim=1)
  starts, stops = set(), set()
  for index in sharding.addressable_devices_indices_map((global_batch_size,)).values():
    rows = index[0]
    starts.add(rows.start or 0)
    stops.add(global_batch_size if rows.stop is None else rows.stop)
  start, stop = min(starts), max(stops)
  size = stop - start
  if global_batch_size % size or start % size:
    raise ConfigError(
      f"the devices of process {jax.process_index()} hold batch rows [{start}, {stop}), which is "
      "not one block of an even split; choose mesh sizes that keep each process's devices together"
    )
  return start // size, global_batch_size // size


def put_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, rules: tuple, global_batch_size: int):
  """Turns this process's rows of a batch into global arrays sharded over the batch axes."""
  out = {}
  for key, local in batch.items():
    sharding = batch_sharding(mesh, rules, ndim=local.ndim)
    global_shape = (global_batch_size,) + local.shape[1:]
    out[key] = jax.make_array_from_process_local_data(sharding, local, global_shape)
  return out


def fit_spec(spec: P, shape: tuple, mesh: Mesh) -> P:
  """`spec` with every dimension the mesh axes do not divide evenly left unsharded."""
  out = []
  for i, dim in enumerate(shape):
    axes = spec[i] if i < len(spec) else None
    names = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
    out.append(axes if dim % math.prod(mesh.shape[n] for n in names) == 0 else None)
  return P(*out)


def state_shardings(abstract: Any, mesh: Mesh, rules: tuple) -> Any:
  """NamedShardings of an nnx state from its logical annotations (uneven dimensions replicated,
  e.g. the 261-entry byte vocabulary over 2 tensor shards)."""
  with nnx.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(abstract)
  return jax.tree.map(lambda a, s: NamedSharding(mesh, fit_spec(s, a.shape, mesh)), abstract, specs)


def create_sharded(make: Callable[..., Any], mesh: Mesh, rules: tuple, *args: Any) -> Any:
  """Builds the nnx object `make(*args)` with its arrays born sharded (never whole on one device).

  The initialiser runs under jit with out_shardings from the logical annotations, so each device
  materialises only its own shards.
  """
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.split(nnx.eval_shape(make, *args))
    shardings = state_shardings(abstract, mesh, rules)
    state = jax.jit(lambda *a: nnx.state(make(*a)), out_shardings=shardings)(*args)
  return nnx.merge(graphdef, state)


def abstract_state(make: Callable[[], Any], mesh: Mesh, rules: tuple) -> tuple:
  """(graphdef, state of sharded jax.ShapeDtypeStruct): restore targets; nothing allocated."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(abstract, mesh, rules)
  return graphdef, jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )


def shardings_of(state: Any) -> Any:
  """The sharding of every array of a live state (jit in/out shardings that keep it in place)."""
  return jax.tree.map(lambda x: x.sharding, state)
