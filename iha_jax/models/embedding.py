"""The token lookup and the form of its gradient.

The lookup `table[tokens]` is a gather; its gradient, as XLA derives it, a scatter-add of
every token's cotangent row into the `[V, D]` table. libtpu lowers that scatter-add two
ways (read off its schedules): a fused scatter, bound by the table's HBM bytes, while a
chip holds at most V / 8 tokens, and above that a custom scatter estimated at ~5 us per
token, the 2.4B step's largest XLA op (90.9 ms per chip). The same sum as a one-hot
matmul, `one_hot(tokens)^T @ cotangent`, runs on the MXU at 2 T V D FLOPs with the
one-hot fused into it (no `[T, V]` array): estimated 23.2 ms there, 1.2 against 40.4 ms
at the 350M shape (docs/performance.md, "The embedding gradient"). The matmul is exact
where the scatter is: the cotangent is in the lookup's output dtype, the products are
accumulated in float32; only the order of the sums differs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.kinds import registry
from iha_jax.parallel.axes import ACTIVATION_BATCH, ACTIVATION_LENGTH
from iha_jax.parallel.rules import free_mesh_axes

# libtpu's custom scatter runs above this many tokens per table row on a chip.
CUSTOM_SCATTER_TOKENS_PER_ROW = 1 / 8
# Above this many table entries V * D the matmul's MXU work per token (2 V D FLOPs at
# v5p's peak, 4.7 us at 2**30) outgrows the custom scatter's ~5 us per token.
MATMUL_MAX_ENTRIES = 2**30


def gradient_form(vocab: int, width: int, tokens_per_device: int) -> str:
  """ "matmul" where it beats libtpu's scatter-add by estimate: on TPU (the platform
  "auto" resolves for), when a device's tokens make libtpu pick its custom scatter and
  the table has at most `MATMUL_MAX_ENTRIES` entries; else "scatter" (CPU, GPU)."""
  platform = registry.auto_backend_override() or jax.default_backend()
  custom = tokens_per_device > CUSTOM_SCATTER_TOKENS_PER_ROW * vocab
  return (
    "matmul" if platform == "tpu" and custom and vocab * width <= MATMUL_MAX_ENTRIES else "scatter"
  )


def tokens_per_device(tokens: jax.Array) -> int:
  """`tokens`' count on one device: split over the mesh axes of the batch and length."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return tokens.size
  axes = {a for name in (ACTIVATION_BATCH, ACTIVATION_LENGTH) for a in free_mesh_axes(mesh, name)}
  return tokens.size // math.prod(mesh.shape[a] for a in axes)


def lookup(table: jax.Array, tokens: jax.Array, dtype: Any, gradient: str = "auto") -> jax.Array:
  """`table: [V, D]` rows at `tokens: [...]` -> `[..., D]` in `dtype`; the table's
  gradient by `gradient`: "scatter" (XLA's scatter-add), "matmul" (one-hot matmul) or
  "auto" (`gradient_form`)."""
  if gradient == "auto":
    gradient = gradient_form(*table.shape, tokens_per_device(tokens))
  if gradient == "scatter":
    return jnp.take(table, tokens, axis=0).astype(dtype)
  if gradient != "matmul":
    raise ValueError(f"gradient must be 'auto', 'scatter' or 'matmul', got {gradient!r}")
  return _lookup_matmul_gradient(table, tokens, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup_matmul_gradient(table: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
  return jnp.take(table, tokens, axis=0).astype(dtype)


def _forward(table, tokens, dtype):
  # The table itself is not kept: its shape and dtype ride on a size-0 slice.
  return _lookup_matmul_gradient(table, tokens, dtype), (tokens, table[:, :0])


def _backward(dtype, residuals, cotangent):
  tokens, empty = residuals
  one_hot = jax.nn.one_hot(tokens, empty.shape[0], dtype=dtype)
  rows = tokens.ndim
  grad = jnp.tensordot(
    one_hot,
    cotangent.astype(dtype),
    axes=(tuple(range(rows)), tuple(range(rows))),
    preferred_element_type=jnp.float32,
  )
  return grad.astype(empty.dtype), None


_lookup_matmul_gradient.defvjp(_forward, _backward)
