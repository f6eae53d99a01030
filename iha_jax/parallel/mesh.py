"""Device mesh with axes ("data", "fsdp", "context", "tensor") from the `mesh` config section."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from iha_jax.checks import is_int
from iha_jax.parallel.rules import MESH_AXES

# Keys of a `mesh` config section that are options, not axes.
MESH_OPTIONS = ("context_load_balance",)


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """`{"data": a, "fsdp": b, "context": c, "tensor": t}` with at most one -1 -> concrete
  `(a, b, c, t)`; an axis left out has size 1.

  -1 takes all devices the other axes leave. The product may be smaller than
  `num_devices` (the mesh then uses the first devices), never larger.

  Raises:
    ValueError: naming the `mesh.*` key that is invalid, or the axes that are not the
      project's (a mesh of your own names: `jax.make_mesh`, then `logical_rules`).
  """
  unknown = [axis for axis in sizes if axis not in MESH_AXES and axis not in MESH_OPTIONS]
  if unknown:
    raise ValueError(
      f"mesh axes {unknown} are not the project's {MESH_AXES}: name them so (e.g. "
      f"{{'data': ..., 'tensor': ...}}), or make your own mesh with jax.make_mesh and map its "
      "axes with iha_jax.parallel.logical_rules({'batch': 'dp', 'heads': 'tp'}, mesh) "
      "(docs/your_model.md)"
    )
  shape = []
  for axis in MESH_AXES:
    size = sizes.get(axis, 1)
    if not (is_int(size, 1) or (is_int(size) and size == -1)):
      raise ValueError(f"mesh.{axis} must be a positive integer or -1, got {size!r}")
    shape.append(size)
  wildcards = [a for a, s in zip(MESH_AXES, shape) if s == -1]
  if len(wildcards) > 1:
    raise ValueError(
      f"at most one mesh axis may be -1, got {', '.join('mesh.' + a for a in wildcards)}"
    )
  fixed = math.prod(s for s in shape if s != -1)
  if wildcards:
    if num_devices % fixed:
      raise ValueError(
        f"mesh.{wildcards[0]}=-1: {num_devices} devices are not divisible by the "
        f"other axes' product {fixed}"
      )
    shape[MESH_AXES.index(wildcards[0])] = num_devices // fixed
  total = math.prod(shape)
  if total > num_devices:
    raise ValueError(
      f"mesh {dict(zip(MESH_AXES, shape))} needs {total} devices, "
      f"only {num_devices} available (mesh.data * mesh.fsdp * mesh.context * mesh.tensor)"
    )
  return tuple(shape)


def create_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The training mesh; `devices` defaults to `jax.devices()` (all processes).

  Auto axis types: shardings propagate through the step (GSPMD/Shardy) from the
  in/out shardings and the logical constraints, as MaxText does.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(sizes, len(devices))
  used = math.prod(shape)
  if used < len(devices) and jax.process_count() > 1:
    raise ValueError(
      f"a multi-process mesh must use every device: mesh {shape} uses {used} of {len(devices)}"
    )
  types = (AxisType.Auto,) * len(MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices[:used])
  except NotImplementedError:
    # A TPU torus whose axes the mesh's sizes do not factor into (fsdp 8 on 4x4x4):
    # let an axis span part of a physical axis rather than refuse the mesh.
    grid = mesh_utils.create_device_mesh(shape, devices[:used], allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=types)
