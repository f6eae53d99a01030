"""Shardings of parameters, optimizer state and batches on the training mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from iha_jax.parallel import context
from iha_jax.parallel.axes import ACTIVATION_BATCH, ACTIVATION_HEADS, KV_HEADS
from iha_jax.parallel.rules import (
  BATCH_AXES,
  CONTEXT,
  LogicalRules,
  free_mesh_axes,
  logical_to_mesh_spec,
  rules_for,
)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Mapping[str, Any] | LogicalRules | None = None) -> Iterator[None]:
  """Makes `mesh` current and the logical-axis rules active, so the layers' activation
  constraints (`with_logical_constraint`) and the kernels' and context parallelism's
  `shard_map`s apply while tracing under it.

  `rules`: None for the project's own (mesh axes data, fsdp, context, tensor; those the
  mesh lacks count as size one); for a mesh of your own, roles to your axes
  (`{"batch": "dp", "heads": "tp"}`, `iha_jax.parallel.rules.logical_rules`) or whole
  rules. A rule naming an axis the mesh lacks fails in one line naming it. Auto or
  Explicit axis types alike (the layers run in `auto_axes` on Explicit ones).
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules_for(mesh, rules)):
    yield


def named_shardings(
  mesh: Mesh,
  logical_specs: Any,
  rules: Mapping[str, Any] | LogicalRules | None = None,
  shapes: Any = None,
  refuse_indivisible: bool = True,
) -> Any:
  """Tree of logical `PartitionSpec`s -> tree of `NamedSharding`s on `mesh`, by `rules`
  (as `activate` takes them; None: the project's, for a mesh with the project's axis
  names; a mesh of your own names needs rules, refused in one line otherwise).

  `shapes`: the same tree's arrays (or anything with `.shape`): key/value heads
  (`kv_heads`) fewer than their mesh axes then stay whole (grouped-query attention under
  a wider tensor split), and any other dimension the axes do not divide is refused in one
  line naming the parameter (`fit_to_shape`); `refuse_indivisible=False` leaves such
  dimensions split, for a caller that reports them in its own terms (the trainer names
  the config keys). Without `shapes`, key/value heads stay whole on every device (valid
  for any G, which the specs do not say): pass `shapes=` (or use
  `iha_jax.nn.param_shardings(mesh, state, rules)`) to split them where the axes divide G."""
  table = rules_for(mesh, rules)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

  def one(path, spec, value=None):
    mesh_spec = logical_to_mesh_spec(spec, table)
    if value is None:
      # G is unknown here, and G heads split over more devices would fail in device_put.
      return NamedSharding(mesh, _whole_kv_heads(spec, mesh_spec))
    mesh_spec = fit_to_shape(
      jax.tree_util.keystr(path), spec, mesh_spec, value.shape, sizes, refuse_indivisible
    )
    return NamedSharding(mesh, mesh_spec)

  is_spec = lambda x: isinstance(x, PartitionSpec)
  if shapes is None:
    return jax.tree_util.tree_map_with_path(one, logical_specs, is_leaf=is_spec)
  return jax.tree_util.tree_map_with_path(one, logical_specs, shapes, is_leaf=is_spec)


def _whole_kv_heads(logical: PartitionSpec, mesh_spec: PartitionSpec) -> PartitionSpec:
  """`mesh_spec` with its `kv_heads` dimensions unsplit."""
  names = tuple(logical) + (None,) * (len(mesh_spec) - len(logical))
  return PartitionSpec(*(None if n == KV_HEADS else a for n, a in zip(names, mesh_spec)))


def fit_to_shape(
  name: str,
  logical: PartitionSpec,
  mesh_spec: PartitionSpec,
  shape: tuple[int, ...],
  sizes: Mapping[str, int],
  refuse_indivisible: bool = True,
) -> PartitionSpec:
  """`mesh_spec` for an array of `shape`: a `kv_heads` dimension that its mesh axes do not
  divide stays whole (G key/value heads under a tensor split wider than G: each device
  keeps all G, and the kernels take the ones its query heads read); any other such
  dimension is a ValueError naming the parameter (kept split when not
  `refuse_indivisible`)."""
  out = []
  for i, (axes, size) in enumerate(zip(tuple(mesh_spec) + (None,) * len(shape), shape)):
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    split = int(np.prod([sizes[a] for a in names])) if names else 1
    if size % split == 0:
      out.append(axes)
      continue
    logical_name = logical[i] if i < len(logical) else None
    if logical_name == KV_HEADS:
      out.append(None)
      continue
    if not refuse_indivisible:
      out.append(axes)
      continue
    raise ValueError(
      f"{name}: dimension {i} ({logical_name}) has {size} entries, which mesh axes "
      f"{names} ({split} devices) do not split evenly; use a size that divides, or rules "
      "that map it elsewhere"
    )
  return PartitionSpec(*out[: len(shape)])


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """`[B, N]` batch arrays: rows over ("data", "fsdp"), tokens over "context" (when the
  mesh has it)."""
  tokens = CONTEXT if CONTEXT in mesh.axis_names else None
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, tokens))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated (scalars, metrics, the step counter)."""
  return NamedSharding(mesh, PartitionSpec())


def shard_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows `[B / process_count, N]` -> global arrays `[B, N]` on `mesh`.

  Every process passes its own, different rows; process p's rows become the p-th
  block of the global batch (the data pipeline shards by `jax.process_index()`). Under
  the balanced context layout (`iha_jax.parallel.context.layout`) the tokens are
  reordered first (`balance_tokens`), as the attention layers then expect.
  """
  sharding = batch_sharding(mesh)
  shards = dict(zip(mesh.axis_names, mesh.axis_sizes)).get(CONTEXT, 1)
  if shards > 1 and context.chunks_per_shard() == 2:  # the balanced token order
    local_batch = {k: context.balance_tokens(np.asarray(v), shards) for k, v in local_batch.items()}
  out = {}
  for key, value in local_batch.items():
    global_shape = (value.shape[0] * jax.process_count(),) + value.shape[1:]
    out[key] = jax.make_array_from_process_local_data(sharding, value, global_shape)
  return out


def kernel_axes(mesh: Mesh | AbstractMesh) -> dict[str, Any] | None:
  """`{batch_axes, head_axis}`: the axes of `mesh` a Pallas kernel splits q/k/v over.

  The active logical-axis rules' mapping of `activation_batch` and `activation_heads`
  (the project's rules when none are active), kept to the axes the mesh has and is not
  already inside a `shard_map` over (manual axes). None for an empty mesh or one whose
  axes are all manual: the kernel is called directly.
  """
  if mesh.empty or all(t == AxisType.Manual for t in mesh.axis_types):
    return None
  heads = free_mesh_axes(mesh, ACTIVATION_HEADS)
  return dict(
    batch_axes=free_mesh_axes(mesh, ACTIVATION_BATCH), head_axis=heads[0] if heads else None
  )
