"""Pseudo-head mixing and collapse: IHA's only new parameters (docs/design.md §1.2, 1.6).

Both are tiny einsums over the head axis; they stay separate functions so the
Flax modules, the XLA path and the Pallas kernels share one definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Precision = jax.lax.PrecisionLike


def pseudo_mix(x: jax.Array, alpha: jax.Array, *, precision: Precision = None) -> jax.Array:
  """Builds P pseudo-heads per target head from all source heads.

  Args:
    x: source-head projections `[B, N, H, d]` (q, k or v).
    alpha: mixing weights `[H, H, P]`, axes (source m, target h, pseudo p).
    precision: matmul precision of the contraction.

  Returns:
    `[B, N, H, P, d]` with `out[b,n,h,p] = sum_m alpha[m,h,p] * x[b,n,m]`, in x.dtype.
  """
  return jnp.einsum(
    "bnmd,mhp->bnhpd",
    x,
    alpha.astype(x.dtype),
    precision=precision,
    preferred_element_type=jnp.float32,
  ).astype(x.dtype)


def collapse_heads(o: jax.Array, collapse: jax.Array, *, precision: Precision = None) -> jax.Array:
  """Collapses the P pseudo-head outputs of every head back to H heads.

  Args:
    o: de-interleaved attention outputs `[B, N, H, P, d]`.
    collapse: `[H, H, P]` ("full": `y[h] = sum_{h',p} collapse[h,h',p] o[h',p]`)
      or `[H, P]` ("per_head", block diagonal: `y[h] = sum_p collapse[h,p] o[h,p]`).
    precision: matmul precision of the contraction.

  Returns:
    `[B, N, H, d]` in o.dtype.
  """
  spec = "bngpd,hgp->bnhd" if collapse.ndim == 3 else "bnhpd,hp->bnhd"
  return jnp.einsum(
    spec, o, collapse.astype(o.dtype), precision=precision, preferred_element_type=jnp.float32
  ).astype(o.dtype)


def mix_to_virtual(x: jax.Array, alpha: jax.Array, *, precision: Precision = None) -> jax.Array:
  """`interleave(pseudo_mix(x, alpha))` in head-major layout, as one einsum.

  Args:
    x: source-head projections `[B, N, H, d]`.
    alpha: mixing weights `[H, H, P]`.
    precision: matmul precision of the contraction.

  Returns:
    `[B, H, N*P, d]`: per target head, the virtual sequence `t = n*P + p`. The
    blockwise attention core tiles the T axis, so producing this layout directly
    saves a transpose of the P-times larger tensor (and its transpose in backward).
  """
  b, n, _, d = x.shape
  h, p = alpha.shape[1:]
  out = jnp.einsum(
    "bnmd,mhp->bhnpd",
    x,
    alpha.astype(x.dtype),
    precision=precision,
    preferred_element_type=jnp.float32,
  )
  return out.reshape(b, h, n * p, d).astype(x.dtype)


def collapse_from_virtual(
  o: jax.Array, collapse: jax.Array, num_pseudo: int, *, precision: Precision = None
) -> jax.Array:
  """`collapse_heads(deinterleave(o))` for a head-major virtual output `o: [B, H, N*P, d]`.

  Returns `[B, N, H, d]` in o.dtype.
  """
  b, h, t, d = o.shape
  o = o.reshape(b, h, t // num_pseudo, num_pseudo, d)
  spec = "bgnpd,hgp->bnhd" if collapse.ndim == 3 else "bhnpd,hp->bnhd"
  return jnp.einsum(
    spec, o, collapse.astype(o.dtype), precision=precision, preferred_element_type=jnp.float32
  ).astype(o.dtype)
