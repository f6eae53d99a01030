"""Rotary position embedding, rotate-half convention (IHA_SPEC 1.4, project choice)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
  """`[d/2]` inverse frequencies `theta ** (-2i / d)` in float32."""
  return theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates `x: [B, T, H, d]` by `positions: [B, T]`, in float32, returned in x.dtype.

  The first half of the head dims is paired with the second half:
  `(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`.
  """
  d = x.shape[-1]
  angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(d, theta)  # [B, T, d/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
