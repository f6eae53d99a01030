"""Rotary position embedding, rotate-half convention (docs/design.md §1.4, project choice)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
  """`[d/2]` inverse frequencies `theta ** (-2i / d)` in float32."""
  return theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """`positions: [B, T]` -> float32 `(cos, sin)`, each `[B, T, d/2]`; share them for q and k."""
  positions = positions.astype(jnp.float32)

  def one_frequency(frequency):
    angles = positions * frequency
    return jnp.cos(angles), jnp.sin(angles)

  # A loop over the d/2 frequencies materialises the tables once. Written as plain
  # broadcasting, XLA fuses cos/sin into every consumer and recomputes them per head
  # and per half (much slower on CPU, docs/performance.md §1; optimization_barrier does
  # not stop it there).
  # Looping over frequencies, not batch rows, keeps a batch-sharded layout intact.
  cos, sin = jax.lax.map(one_frequency, rope_frequencies(head_dim, theta))
  return jnp.moveaxis(cos, 0, -1), jnp.moveaxis(sin, 0, -1)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE of `x: [..., d]` with tables broadcastable to `[..., d/2]`.

  The first half of the head dims is paired with the second half:
  `(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`, in float32, returned in x.dtype.
  """
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates `x: [B, T, H, d]` by `positions: [B, T]` (see `rotate`)."""
  cos, sin = rope_tables(positions, x.shape[-1], theta)
  return rotate(x, cos[:, :, None, :], sin[:, :, None, :])
