"""The layers' call outside `jit`: one compiled function per configuration, not op-by-op.

Called eagerly, `iha_jax.nn.call.apply_layer` would dispatch each of its operations on
its own, and rebuild the XLA core's `lax.map` and `scan` bodies every call (a new closure
is a cache miss: about a second of compiling per call of a tiny layer on CPU).
`call_layer` instead runs it as one `jax.jit` of the same function, cached by JAX per
configuration, shapes, dtypes and options (the config and the logical-axis rules are
static). Every check still raises its own error while that function is traced, before
anything compiles; a cached call's lengths are checked against `max_len` first, while
they are concrete (traced, an overflow could only poison the output). A call that is
itself being traced (inside a user's `jit`, `grad`, `scan`, ...) runs `apply_layer` as
it is, compiled with its caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np

from iha_jax.checks import is_int, is_traced
from iha_jax.kinds import AttentionConfig, registry
from iha_jax.nn.cache import LayerCache, check_cache
from iha_jax.nn.call import apply_layer
from iha_jax.nn.functional import check_input, new_token_validity
from iha_jax.parallel import context as context_parallel


def call_layer(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  *,
  mask: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  layer: int | jax.Array | None = None,
  cache: Any = None,
  dropout_rng: Callable[[], jax.Array | None] | None = None,
  return_probabilities: bool = False,
  context: jax.Array | None = None,
) -> Any:
  """`apply_layer(params, x, cfg, ...)` (the same arguments and result), compiled once per
  configuration, shapes, dtypes and options when called outside any trace.

  numpy arrays become JAX arrays first (`jnp.asarray`: under `jax.set_mesh` replicated on
  the mesh, which the layer's Explicit-axes path needs to name its output sharding)."""
  x, mask, segment_ids, positions, context = (
    jnp.asarray(a) if isinstance(a, np.ndarray) else a
    for a in (x, mask, segment_ids, positions, context)
  )
  arrays = dict(mask=mask, segment_ids=segment_ids, positions=positions, context=context)
  layer_array = None if layer is None or is_int(layer) else layer
  static = _static_key(cfg, layer if layer_array is None else None, return_probabilities)
  leaves = jax.tree.leaves((params, x, arrays, layer_array, cache))
  eager = static is None or any(
    is_traced(leaf) or not isinstance(leaf, jax.Array) for leaf in leaves
  )
  if eager:
    return apply_layer(
      params,
      x,
      cfg,
      **arrays,
      layer=layer,
      cache=cache,
      dropout_rng=dropout_rng,
      return_probabilities=return_probabilities,
    )
  if cache is not None:  # the lengths while concrete (apply_layer refuses misuse first)
    check_input(x, cfg)
    if isinstance(cache, LayerCache):
      check_cache(cfg, cache, x, None if mask is None else new_token_validity(mask, x))
  # Drawn here, where apply_layer would draw it: the stream advances outside the compile.
  dropout_key = None
  draws = cache is None and not return_probabilities and cfg.dropout_rate > 0
  if draws and dropout_rng is not None:
    dropout_key = dropout_rng()
  return _compiled_layer(params, x, arrays, layer_array, dropout_key, cache, static=static)


def _static_key(
  cfg: AttentionConfig, layer: int | None, return_probabilities: bool
) -> tuple[Any, ...] | None:
  """What the compiled call depends on beyond its arrays (jit keys the mesh and jax's
  config itself): the config, a Python-int layer number, the use, and what the layer
  reads from its context while tracing (the logical-axis rules, `auto_backend`, the
  context-parallel layout); None when something is unhashable (then the call runs
  eagerly)."""
  key = (
    cfg,
    layer,
    bool(return_probabilities),
    tuple(flax.linen.get_logical_axis_rules()),
    registry.auto_backend_override(),
    context_parallel.chunks_per_shard(),
  )
  try:
    hash(key)
  except TypeError:
    return None
  return key


@functools.partial(jax.jit, static_argnames=("static",))
def _compiled_layer(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  arrays: Mapping[str, jax.Array | None],
  layer_array: jax.Array | None,
  dropout_key: jax.Array | None,
  cache: LayerCache | None,
  *,
  static: tuple[Any, ...],
) -> Any:
  """`apply_layer` under `jit`; `static` as `_static_key` makes it."""
  cfg, layer, return_probabilities = static[:3]
  return apply_layer(
    params,
    x,
    cfg,
    **arrays,
    layer=layer if layer_array is None else layer_array,
    cache=cache,
    dropout_rng=None if dropout_key is None else lambda: dropout_key,
    return_probabilities=return_probabilities,
  )
