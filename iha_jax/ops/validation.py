"""Argument checks and defaults for the attention entry points.

Everything here runs in Python on static shapes, so bad input fails with a
message naming the argument before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.ops.options import AttentionOptions, BlockSizes


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def is_int(value: Any, minimum: int | None = None) -> bool:
  """Whether `value` is a Python int (not a bool) and, if `minimum` is given, >= it.

  The one check behind every "must be a positive integer" message of the project.
  """
  return (
    isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
  )


def check_arrays(
  names: Sequence[str],
  arrays: Sequence[jax.Array],
  rank: int,
  layout: str,
  *,
  same_shape: bool = True,
) -> None:
  """Floating arrays of `rank` and one dtype; `same_shape`: all of one shape, else one
  `[B, N, H]` prefix (the last axis may differ, e.g. v's width `dv`)."""
  for name, x in zip(names, arrays):
    if jnp.ndim(x) != rank:
      raise ValueError(f"{name} must have rank {rank} {layout}, got shape {_shape(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {jnp.result_type(x)}.")
  listed = f"{', '.join(names[:-1])} and {names[-1]}"
  shapes = [_shape(x) if same_shape else _shape(x)[:3] for x in arrays]
  if any(s != shapes[0] for s in shapes):
    what = "the same shape" if same_shape else "the same [B, N, H]"
    got = ", ".join(f"{n} {_shape(x)}" for n, x in zip(names, arrays))
    raise ValueError(f"{listed} must have {what} {layout}, got {got}.")
  dtypes = [jnp.result_type(x) for x in arrays]
  if any(t != dtypes[0] for t in dtypes):
    raise ValueError(f"{listed} must share one dtype, got {', '.join(str(t) for t in dtypes)}.")


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, *, value_width: bool = False) -> None:
  """q, k: floating `[B, N, H, d]` of one shape and dtype; v the same, or with
  `value_width` only the same `[B, N, H]` (`[B, N, H, dv]`)."""
  if not value_width:
    check_arrays(("q", "k", "v"), (q, k, v), 4, "[B, N, H, d]")
    return
  check_arrays(("q", "k"), (q, k), 4, "[B, N, H, d]")
  check_arrays(("q", "v"), (q, v), 4, "[B, N, H, dv]", same_shape=False)


def check_mixing(
  num_heads: int, alpha_q: jax.Array, alpha_k: jax.Array, alpha_v: jax.Array, collapse: jax.Array
) -> int:
  """alpha_*: `[H, H, P]`, collapse `[H, H, P]` or `[H, P]`; returns P."""
  for name, a in (("alpha_q", alpha_q), ("alpha_k", alpha_k), ("alpha_v", alpha_v)):
    s = _shape(a)
    if len(s) != 3 or s[0] != num_heads or s[1] != num_heads:
      raise ValueError(
        f"{name} must have shape [H, H, P] = [{num_heads}, {num_heads}, P] (H from q), got {s}."
      )
  num_pseudo = _shape(alpha_q)[2]
  if num_pseudo < 1:
    raise ValueError(f"alpha_q's last axis (num_pseudo P) must be >= 1, got {num_pseudo}.")
  for name, a in (("alpha_k", alpha_k), ("alpha_v", alpha_v)):
    if _shape(a)[2] != num_pseudo:
      raise ValueError(
        f"{name} has P = {_shape(a)[2]} pseudo-heads but alpha_q has "
        f"{num_pseudo}; all mixing tensors must share P."
      )
  full, per_head = (num_heads, num_heads, num_pseudo), (num_heads, num_pseudo)
  if _shape(collapse) not in (full, per_head):
    raise ValueError(
      f"collapse must have shape {list(full)} (full) or {list(per_head)} "
      f"(per_head), got {_shape(collapse)}."
    )
  return num_pseudo


def check_options(q: jax.Array, options: AttentionOptions) -> AttentionOptions:
  """`options` checked against q `[B, N, H, ...]`, with `positions` defaulted (`arange(N)`
  per row): what every implementation receives."""
  window, causal, rope_theta = options.window, options.causal, options.rope_theta
  if window is not None and not is_int(window, 1):
    raise ValueError(f"window must be None (global) or an int >= 1, got {window!r}.")
  if not isinstance(causal, bool):
    raise ValueError(f"causal must be a bool (True: causal, False: bidirectional), got {causal!r}.")
  if options.block_sizes is not None and not isinstance(options.block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes or None, got {options.block_sizes!r}.")
  batch_tokens = _shape(q)[:2]
  for name in ("segment_ids", "positions"):
    x = getattr(options, name)
    if x is None:
      continue
    if _shape(x) != batch_tokens:
      raise ValueError(f"{name} must have shape [B, N] = {list(batch_tokens)}, got {_shape(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must be an integer array (int32), got {jnp.result_type(x)}.")
  if rope_theta is not None:
    if not rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0 or None (no RoPE), got {rope_theta!r}.")
    if _shape(q)[-1] % 2:
      raise ValueError(
        f"RoPE needs an even head_dim d, got d = {_shape(q)[-1]}; use an even d or rope_theta=None."
      )
  return dataclasses.replace(options, positions=default_positions(q, options.positions))


def default_positions(q: jax.Array, positions: jax.Array | None) -> jax.Array:
  """`positions`, or `arange(N)` per row of q `[B, N, ...]`, int32 `[B, N]`."""
  if positions is not None:
    return positions
  b, n = q.shape[:2]
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
