"""The interleaved virtual sequence (docs/design.md §1.3-1.4).

Token n's P pseudo-tokens become consecutive virtual tokens: `t = n * P + p`,
so every head sees a sequence of length `T = N * P`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def interleave(x: jax.Array) -> jax.Array:
  """`[B, N, H, P, d]` -> `[B, N*P, H, d]`, virtual token `t = n*P + p`."""
  b, n, h, p, d = x.shape
  return jnp.swapaxes(x, 2, 3).reshape(b, n * p, h, d)


def deinterleave(y: jax.Array, num_pseudo: int) -> jax.Array:
  """`[B, N*P, H, d]` -> `[B, N, H, P, d]`; inverse of `interleave`."""
  b, t, h, d = y.shape
  return jnp.swapaxes(y.reshape(b, t // num_pseudo, num_pseudo, h, d), 2, 3)


def virtual_positions(positions: jax.Array, num_pseudo: int) -> jax.Array:
  """Token positions `[B, N]` -> RoPE positions of the virtual tokens `[B, N*P]`.

  Pseudo-token p of a token at position `pos` sits at `pos * P + p`, so packed
  sequences (positions restarting per segment) restart in virtual space too.
  """
  b, n = positions.shape
  offsets = jnp.arange(num_pseudo, dtype=positions.dtype)
  return (positions[:, :, None] * num_pseudo + offsets).reshape(b, n * num_pseudo)


def virtual_segment_ids(segment_ids: jax.Array, num_pseudo: int) -> jax.Array:
  """Segment ids `[B, N]` -> `[B, N*P]`: every pseudo-token keeps its token's segment."""
  return jnp.repeat(segment_ids, num_pseudo, axis=1)
