"""RMSNorm as a pure function: the model's block norms and the layers' `qk_norm`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype=None) -> jax.Array:
  """`x / rms(x) * scale` over the last axis: `x: [..., n]`, `scale: [n]`; statistics and
  the product in float32, the result in `dtype` (x.dtype when None)."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype if dtype is None else dtype)
