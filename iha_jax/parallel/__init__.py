"""Device meshes, logical-axis sharding rules and multi-process start-up."""

from iha_jax.parallel.distributed import initialize
from iha_jax.parallel.mesh import create_mesh, resolve_mesh_shape
from iha_jax.parallel.rules import (
  BATCH_AXES,
  LOGICAL_AXIS_RULES,
  MESH_AXES,
  ROLES,
  logical_rules,
  logical_to_mesh_spec,
)
from iha_jax.parallel.sharding import (
  activate,
  batch_sharding,
  fit_to_shape,
  named_shardings,
  replicated,
  shard_batch,
)

__all__ = [
  "BATCH_AXES",
  "LOGICAL_AXIS_RULES",
  "MESH_AXES",
  "ROLES",
  "activate",
  "batch_sharding",
  "create_mesh",
  "fit_to_shape",
  "initialize",
  "logical_rules",
  "logical_to_mesh_spec",
  "named_shardings",
  "replicated",
  "resolve_mesh_shape",
  "shard_batch",
]
