"""Train state (step, parameters, optimizer state), its shardings and sharded init."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from iha_jax.models.functional_lm import FunctionalTransformerLM, Params
from iha_jax.parallel import named_shardings, replicated


@flax.struct.dataclass
class TrainState:
  """Everything a step updates; a pytree (checkpointed as is).

  Attributes:
    step: int32 scalar, optimizer steps taken.
    params: parameter dict in `FunctionalTransformerLM`'s layout (param_dtype, float32 by default).
    opt_state: optax state (AdamW moments mirror `params`).
  """

  step: jax.Array
  params: Params
  opt_state: optax.OptState


def _dict_path(path: tuple) -> tuple[str, ...]:
  """Trailing dict keys of a key path: the parameter a moment leaf belongs to."""
  keys = []
  for entry in reversed(path):
    if not isinstance(entry, jax.tree_util.DictKey):
      break
    keys.append(str(entry.key))
  return tuple(reversed(keys))


def state_shardings(
  model: FunctionalTransformerLM, abstract_state: TrainState, mesh: Mesh
) -> TrainState:
  """`NamedSharding` of every state leaf: parameters by the logical-axis rules, optimizer
  moments like their parameter (ZeRO: FSDP shards them too), the rest replicated."""
  # Indivisible dimensions stay split here: preflight.check_shardable names the config keys.
  param_shardings = named_shardings(
    mesh, model.logical_specs(), shapes=abstract_state.params, refuse_indivisible=False
  )
  by_path = {
    _dict_path(path): s for path, s in jax.tree_util.tree_leaves_with_path(param_shardings)
  }
  shapes = {
    _dict_path(path): x.shape
    for path, x in jax.tree_util.tree_leaves_with_path(abstract_state.params)
  }

  def opt_sharding(path, leaf) -> NamedSharding:
    key = _dict_path(path)
    if key in by_path and shapes[key] == leaf.shape:
      return by_path[key]
    return replicated(mesh)

  opt = jax.tree_util.tree_map_with_path(opt_sharding, abstract_state.opt_state)
  return TrainState(step=replicated(mesh), params=param_shardings, opt_state=opt)


def make_init_fn(model: FunctionalTransformerLM, tx: optax.GradientTransformation):
  """`seed -> TrainState` (jit it with `out_shardings` to create a sharded state)."""

  def init(seed: jax.Array) -> TrainState:
    params = model.init(seed)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return init


def create_state(
  model: FunctionalTransformerLM, tx: optax.GradientTransformation, mesh: Mesh, seed: int
) -> tuple[TrainState, TrainState]:
  """A fresh sharded state and its shardings; parameters never exist unsharded.

  The init is a pure function of `seed` (threefry is partitionable), so any mesh gives
  the same values.
  """
  init = make_init_fn(model, tx)
  abstract = jax.eval_shape(init, jnp.uint32(seed))
  shardings = state_shardings(model, abstract, mesh)
  state = jax.jit(init, out_shardings=shardings)(jnp.uint32(seed))
  return state, shardings


def state_from_params(
  params: Any, tx: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
  """Step 0 and a fresh optimizer state for `params` (e.g. another run's), sharded as
  `shardings`."""
  fresh = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p))
  return jax.jit(fresh, out_shardings=shardings)(params)


def abstract_state(
  model: FunctionalTransformerLM, tx: optax.GradientTransformation, mesh: Mesh
) -> tuple[Any, TrainState]:
  """`ShapeDtypeStruct`s with shardings (restore targets) and the shardings themselves."""
  abstract = jax.eval_shape(make_init_fn(model, tx), jnp.uint32(0))
  shardings = state_shardings(model, abstract, mesh)
  target = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
  )
  return target, shardings
