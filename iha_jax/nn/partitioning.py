"""NNX parameters annotated with logical axis names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx


def logical_param(
  init: jax.nn.initializers.Initializer,
  axes: Sequence[str | None],
  key: jax.Array,
  shape: Sequence[int],
  dtype: Any,
) -> nnx.Param:
  """`nnx.Param(init(key, shape, dtype))` carrying `axes` as `out_sharding` metadata.

  Annotation only: eager sharding is off, so the parameter is created without a mesh
  (tests, single device, `nnx.eval_shape`); the parallel layer maps the names to mesh
  axes with `nnx.get_partition_spec` under `flax.linen.logical_axis_rules`.
  """
  if len(axes) != len(shape):
    raise ValueError(f"axes {tuple(axes)} must name every dimension of shape {tuple(shape)}")
  return nnx.Param(
    nnx.with_partitioning(init, tuple(axes), eager_sharding=False)(key, tuple(shape), dtype)
  )
