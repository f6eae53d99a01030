"""Parameters annotated with logical axis names (NNX), and the helpers that read them back
from either front end (`unbox`, `logical_specs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen
import jax
from flax import nnx

from iha_jax.parallel import named_shardings


def logical_param(
  init: jax.nn.initializers.Initializer,
  axes: Sequence[str | None],
  key: jax.Array,
  shape: Sequence[int],
  dtype: Any,
) -> nnx.Param:
  """`nnx.Param(init(key, shape, dtype))` carrying `axes` as `out_sharding` metadata only
  (no eager sharding: the parameter is created without a mesh)."""
  if len(axes) != len(shape):
    raise ValueError(f"axes {tuple(axes)} must name every dimension of shape {tuple(shape)}")
  return nnx.Param(
    nnx.with_partitioning(init, tuple(axes), eager_sharding=False)(key, tuple(shape), dtype)
  )


def unbox(tree: Any) -> Any:
  """Linen `params` (or whole variables) with their `nn.LogicallyPartitioned` boxes
  removed: the same tree of plain arrays (`params["wq"].shape` works), which is what
  `apply` also accepts and what NNX's `nnx.Param`s hold. Plain arrays pass through."""
  return flax.linen.meta.unbox(tree)


def param_shardings(mesh: Any, tree: Any, rules: Any = None) -> Any:
  """`NamedSharding`s of every parameter of `tree` (an NNX module or state, or Linen
  variables) on `mesh` by `rules` (`iha_jax.parallel.activate`'s), fitted to the
  parameters' shapes: key/value heads fewer than their mesh axes stay whole
  (`iha_jax.parallel.fit_to_shape`). For `jax.device_put(state, param_shardings(...))`."""
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree, nnx.Param)
  return named_shardings(mesh, logical_specs(tree), rules, shapes=unbox(tree))


def logical_specs(tree: Any) -> Any:
  """The logical axis names of every parameter, as a tree of `PartitionSpec`s (e.g.
  `P("embed", "heads", "head_dim")` for `wq`): from boxed Linen variables or an NNX
  module or state (parameters without names, e.g. `nnx.Linear`'s, get `P()`). Map them to
  a mesh with `iha_jax.parallel.named_shardings(mesh, specs, rules)` (docs/your_model.md).
  """
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree, nnx.Param)
  # No rules while reading: under active rules (`iha_jax.parallel.activate`) flax would
  # hand back mesh axes instead of the names.
  with flax.linen.logical_axis_rules(()):
    if isinstance(tree, nnx.State):
      return nnx.get_partition_spec(tree)
    return flax.linen.get_partition_spec(tree)
