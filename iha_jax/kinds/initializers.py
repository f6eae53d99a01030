"""Initializers (`jax.nn.initializers`' `(key, shape, dtype)`) for the head mixings of IHA
and Talking-Heads, each plus optional `N(0, noise_std)` noise, and `fold_fan_in`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

Initializer = jax.nn.initializers.Initializer
Shape = Sequence[int]


def _with_noise(base: jax.Array, key: jax.Array, noise_std: float, dtype) -> jax.Array:
  if noise_std:
    base = base + noise_std * jax.random.normal(key, base.shape, jnp.float32)
  return base.astype(dtype)


def identity_mixing_init(noise_std: float = 0.0) -> Initializer:
  """`alpha_*: [H, H, P]` (source m, target h, pseudo p) `= 1 if m == h else 0`: every
  pseudo-head of head h starts as a copy of source head h."""

  def init(key: jax.Array, shape: Shape, dtype=jnp.float32) -> jax.Array:
    if len(shape) != 3 or shape[0] != shape[1]:
      raise ValueError(f"identity_mixing_init: shape must be [H, H, P], got {tuple(shape)}")
    eye = jnp.eye(shape[0], dtype=jnp.float32)[:, :, None]
    return _with_noise(jnp.broadcast_to(eye, shape), key, noise_std, dtype)

  return init


def identity_collapse_init(noise_std: float = 0.0) -> Initializer:
  """`collapse: [H, H, P]` ("full", `= 1/P if h == h' else 0`) or `[H, P]` ("per_head",
  `1/P`): each head starts as the mean of its own P pseudo-head outputs."""

  def init(key: jax.Array, shape: Shape, dtype=jnp.float32) -> jax.Array:
    if len(shape) == 3 and shape[0] == shape[1]:
      base = jnp.eye(shape[0], dtype=jnp.float32)[:, :, None] / shape[2]
    elif len(shape) == 2:
      base = jnp.full(shape, 1.0 / shape[1], jnp.float32)
    else:
      raise ValueError(
        f"identity_collapse_init: shape must be [H, H, P] or [H, P], got {tuple(shape)}"
      )
    return _with_noise(jnp.broadcast_to(base, shape), key, noise_std, dtype)

  return init


def identity_talking_init(noise_std: float = 0.0) -> Initializer:
  """Talking-Heads' `talk_logits, talk_weights: [H, H]`: the identity (each head talks only
  to itself: plain multi-head attention)."""

  def init(key: jax.Array, shape: Shape, dtype=jnp.float32) -> jax.Array:
    if len(shape) != 2 or shape[0] != shape[1]:
      raise ValueError(f"identity_talking_init: shape must be [H, H], got {tuple(shape)}")
    return _with_noise(jnp.eye(shape[0], dtype=jnp.float32), key, noise_std, dtype)

  return init


def fold_fan_in(init: Initializer, num_in_axes: int) -> Initializer:
  """Applies a 2-D initializer to an N-D kernel with `num_in_axes` leading input axes.

  The kernel is initialised as the matrix `[prod(in_axes), prod(out_axes)]` and reshaped,
  as `DenseGeneral` does, so fan-in based initializers (lecun_normal, ...) see the true
  fan-in: `D` for `wq: [D, H, d]` and `H*d` for `wo: [H, d, D]`.
  """

  def folded(key: jax.Array, shape: Shape, dtype=jnp.float32) -> jax.Array:
    shape = tuple(shape)
    matrix = (math.prod(shape[:num_in_axes]), math.prod(shape[num_in_axes:]))
    return init(key, matrix, dtype).reshape(shape)

  return folded
