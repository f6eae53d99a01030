"""Source heads -> the flash kernels' virtual rows, in HBM (`flash.attention`'s pipeline).

IHA's P pseudo-queries, keys and values per head are made once per call by einsums
(`bnmd,mhp->bhnpd`) and laid out head-major as the `T = N * P` virtual rows each target
head attends over; the softmax scale `1/sqrt(d)` rides on `alpha_q` (on q for MHA).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from iha_jax.core.rope import rope_frequencies


@dataclasses.dataclass(frozen=True)
class Mixing:
  """Source heads -> the kernels' padded virtual rows (static: a custom_vjp argument)."""

  theta: float | None  # RoPE's base (None: no RoPE)
  scale: float  # the softmax scale, carried by the queries
  rows_q: int
  rows_k: int
  rotate_in_kernel: bool  # RoPE by the kernels, per tile in VMEM (else here, in HBM)

  def __call__(self, q, k, v, alphas, positions, key_positions):
    a_q, a_k, a_v = alphas if alphas is not None else (None, None, None)
    theta = None if self.rotate_in_kernel else self.theta
    qv = _mix(q, a_q, positions, theta, scale=self.scale)
    kv = _mix(k, a_k, key_positions, theta)
    vv = _mix(v, a_v, key_positions, None)
    return _pad_rows(qv, self.rows_q), _pad_rows(kv, self.rows_k), _pad_rows(vv, self.rows_k)

  def tables(self, positions, key_positions, num_pseudo: int, d: int):
    """The kernels' RoPE tables of the query and key rows (`_rope_table`) at the virtual
    positions `pos * P + p`, or None (no RoPE, or RoPE in HBM)."""
    if not self.rotate_in_kernel:  # (which implies RoPE)
      return None
    rows = ((positions, self.rows_q), (key_positions, self.rows_k))
    return tuple(_rope_table(x, num_pseudo, d, self.theta, r) for x, r in rows)


def pseudo_per_head(alphas) -> int:
  """P: the pseudo-heads per head (1 for MHA, `alphas` None)."""
  return 1 if alphas is None else alphas[0].shape[2]


def _rope_table(positions: jax.Array, num_pseudo: int, d: int, theta: float, rows: int):
  """`cos | sin` `[B, rows, 2d]` float32 of the virtual rows of tokens at `positions`
  `[B, N]` (virtual position `pos * P + p`; padding rows 0): `cos = [c, c]` and
  `sin = [-s, s]` per frequency, so `x cos + swap(x) sin` is the rotate-half RoPE (one
  table, one DMA per tile)."""
  b = positions.shape[0]
  cos, sin = (x.reshape(b, -1, d // 2) for x in _virtual_cos_sin(positions, num_pseudo, d, theta))
  cos, sin = (jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0))) for x in (cos, sin))
  return jnp.concatenate([cos, cos, -sin, sin], axis=-1)


def _virtual_cos_sin(positions: jax.Array, num_pseudo: int, d: int, theta: float):
  """RoPE's `(cos, sin)`, each `[B, N, P, d/2]` float32, at the virtual positions
  `pos * P + p`, by angle addition (`a = pos * P * f` per token, `b = p * f` per
  pseudo-head): the sines and cosines, a polynomial each on TPU's vector units, are taken
  at N tokens, not N * P rows (docs/performance.md §14), each angle rounded once, as
  `(pos * P + p) * f` is."""
  frequencies = rope_frequencies(d, theta)
  token = (positions * num_pseudo).astype(jnp.float32)[..., None] * frequencies  # [B, N, d/2]
  pseudo = jnp.arange(num_pseudo, dtype=jnp.float32)[:, None] * frequencies  # [P, d/2]
  cos_a, sin_a = jnp.cos(token)[:, :, None], jnp.sin(token)[:, :, None]
  cos_b, sin_b = jnp.cos(pseudo), jnp.sin(pseudo)
  return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


def _rotate_virtual(x: jax.Array, positions: jax.Array, num_pseudo: int, theta: float | None):
  """RoPE of `x: [B, Hx, N, P, d]` (float32) at virtual positions `pos * P + p`."""
  if theta is None:
    return x
  cos, sin = (t[:, None] for t in _virtual_cos_sin(positions, num_pseudo, x.shape[-1], theta))
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _mix(x: jax.Array, alpha: jax.Array | None, positions, theta, scale: float = 1.0):
  """Source heads `[B, N, S, d]` -> virtual rows `[B, Ht, N * P, d]` in x.dtype: mixed
  by `alpha: [S, Ht, P]` (None: each head itself, P = 1), rotated, times `scale`."""
  b, n, _, d = x.shape
  if alpha is None:
    mixed = jnp.swapaxes(x.astype(jnp.float32), 1, 2)[:, :, :, None]  # [B, S, N, 1, d]
    p = 1
  else:
    p = alpha.shape[2]
    mixed = jnp.einsum(
      "bnmd,mhp->bhnpd", x, (alpha * scale).astype(x.dtype), preferred_element_type=jnp.float32
    )
    scale = 1.0
  mixed = _rotate_virtual(mixed, positions, p, theta) * scale
  return mixed.reshape(b, mixed.shape[1], n * p, d).astype(x.dtype)


def virtual_segment_ids(ids: jax.Array, num_pseudo: int, rows: int, padding: int) -> jax.Array:
  """Token ids `[B, N]` -> virtual ids `[B, rows]` (padded with `padding`)."""
  virtual = jnp.repeat(ids.astype(jnp.int32), num_pseudo, axis=1)
  return jnp.pad(virtual, ((0, 0), (0, rows - virtual.shape[1])), constant_values=padding)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, 0)))
