"""A layer called outside `jit`: one compiled call per configuration (nothing compiles on
a warm call), the same outputs, errors and dropout as under a user's `jit`, and numpy
inputs under a mesh with Explicit axes."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from iha_jax.nn import AttentionLinen, InterleavedHeadAttention, MultiHeadAttention

B, N, D, H = 1, 8, 32, 4
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _compiles(call) -> int:
  """How many XLA compilations `call()` runs."""
  events = []
  listener = lambda event, duration, **kwargs: events.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    jax.block_until_ready(call())
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return sum(event == COMPILE_EVENT for event in events)


@pytest.mark.parametrize("cls", [InterleavedHeadAttention, MultiHeadAttention])
def test_a_warm_eager_call_compiles_nothing_and_equals_the_jitted_call(cls):
  layer = cls(D, H, D // H, implementation="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (B, N, D))
  y = layer(x)
  assert _compiles(lambda: layer(x)) == 0
  chex.assert_trees_all_close(y, nnx.jit(lambda layer, x: layer(x))(layer, x), atol=1e-6)
  linen = AttentionLinen(layer.config)
  params = linen.init(jax.random.key(0), x)
  linen.apply(params, x)
  assert _compiles(lambda: linen.apply(params, x)) == 0
  probabilities = layer(x, return_probabilities=True)[1]
  np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="x must have shape"):
    layer(x[..., :-1])


def test_eager_dropout_draws_the_stream_as_under_jit():
  layer = InterleavedHeadAttention(
    D, H, D // H, num_pseudo=2, implementation="xla", dropout_rate=0.5, rngs=nnx.Rngs(0)
  )
  x = jax.random.normal(jax.random.key(1), (B, N, D))
  eager = layer(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
  jitted = nnx.jit(lambda layer, x, rngs: layer(x, deterministic=False, rngs=rngs))(
    layer, x, nnx.Rngs(dropout=7)
  )
  chex.assert_trees_all_close(eager, jitted, atol=1e-6)
  assert not np.allclose(layer(x, deterministic=False), layer(x, deterministic=False))
  with pytest.raises(ValueError, match="pass deterministic"):
    layer(x)


def test_numpy_input_under_an_explicit_mesh():
  """numpy x (and context) are taken as replicated arrays on the current mesh."""
  layer = InterleavedHeadAttention(D, H, D // H, num_pseudo=2, rngs=nnx.Rngs(0))
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, N, D)))
  expected = layer(jnp.asarray(x))
  linen = AttentionLinen(layer.config)
  params = linen.init(jax.random.key(0), x)
  cross = InterleavedHeadAttention(
    D, H, D // H, num_pseudo=2, causal=False, rope_theta=None, rngs=nnx.Rngs(0)
  )
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(layer(x), expected, atol=1e-5)
    np.testing.assert_allclose(linen.apply(params, x), linen.apply(params, jnp.asarray(x)))
    np.testing.assert_allclose(
      cross(x, context=x[:, :5]), cross(jnp.asarray(x), context=jnp.asarray(x[:, :5])), atol=1e-5
    )
