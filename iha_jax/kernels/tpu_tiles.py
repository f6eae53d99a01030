"""Tiles of the TPU (Mosaic) kernels: token tiles and their scoped-VMEM estimate.

`tiled` picks a kernel configuration's tiles: about 256 virtual query rows and 512
virtual key rows, halved (keys first) until `vmem_estimate` fits `VMEM_BUDGET_BYTES` of
Mosaic's default 16 MiB scoped VMEM. The estimate was calibrated against XLA:TPU
(docs/compile_checks.md); docs/compile_matrix.md has what the compiler reports.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from iha_jax.core.options import round_up
from iha_jax.kernels.common import Config

_LANES = 128


def _tokens(name: str, value: int | None, num_pseudo: int) -> int | None:
  """A tile of `value` virtual tokens in tokens (the kernels tile whole tokens)."""
  if value is None:
    return None
  if value % num_pseudo:
    raise ValueError(
      f"{name} = {value} virtual tokens must be a multiple of P = {num_pseudo} for the "
      "TPU kernels (a tile holds whole tokens)."
    )
  return value // num_pseudo


# Mosaic's default scoped-VMEM limit on v4, v5e, v5p and v6e; tiles are chosen to fit
# it with room for the compiler's own temporaries, so no kernel needs a larger limit.
SCOPED_VMEM_BYTES = 16 * 2**20
VMEM_BUDGET_BYTES = 12 * 2**20


def _tile_bytes(shape: tuple[int, ...], itemsize: int) -> int:
  """VMEM bytes of an array padded to Mosaic's (sublane, 128-lane) tiles."""
  *lead, rows, lanes = shape
  sublanes = 8 * max(1, 4 // itemsize)
  return math.prod(lead) * round_up(rows, sublanes) * round_up(lanes, _LANES) * itemsize


def vmem_estimate(cfg: Config, itemsize: int) -> int:
  """Estimate (calibrated against XLA:TPU, docs/compile_checks.md) of the scoped VMEM of
  the largest of the three kernels: double-buffered blocks, scratch, the float32 pseudo
  pieces built while mixing and the stacked `[P*bq, P*bk]` score temporaries."""
  p, bq, bk = cfg.num_pseudo, cfg.block_q, cfg.block_k
  heads = cfg.num_heads if cfg.mixing else 1  # source blocks: all sources, or one head
  kv_heads = cfg.num_kv_heads if cfg.mixing else 1
  w, wv = cfg.width, cfg.value_width
  f32 = lambda *shape: _tile_bytes(shape, 4)
  x = lambda *shape: _tile_bytes(shape, itemsize)
  tokens = 2 * (2 * f32(p, cfg.half) + 2 * f32(p * bq, 1) + 2 * f32(1, p * bk))
  sources = 2 * (x(heads, bq, w) + x(kv_heads, bk, w) + x(kv_heads, bk, wv))
  pseudo = x(p, bq, w) + x(p, bk, w) + x(p, bk, wv)  # scratch
  mixing = p * (f32(max(bq, bk), w) + f32(bk, wv))  # float32 pieces of one tile
  scores = 5 * f32(p * bq, p * bk)
  per_query = 2 * (x(p, bq, wv) + 2 * f32(p, bq, 1))  # do, lse, delta (o, lse forward)
  forward = sources + pseudo + per_query + 2 * f32(p * bq, 1) + f32(p * bq, wv)
  dq = sources + pseudo + per_query + 2 * f32(heads, bq, w) + f32(p, bq, w)
  dkv = sources + pseudo + per_query + 2 * (f32(kv_heads, bk, w) + f32(kv_heads, bk, wv))
  dkv += f32(p, bk, w) + f32(p, bk, wv)
  return tokens + mixing + scores + max(forward, dq, dkv)


def tiled(
  cfg: Config, n: int, dtype, block_q: int | None, block_k: int | None, kv_tokens: int | None = None
) -> Config:
  """cfg with its tiles: block_q, block_k and padded tokens `seq_len` (tokens), and, for a
  sliced call (`kv_tokens` keys, `cfg.sliced`), the padded keys `kv_seq_len`.

  `block_q`, `block_k`: virtual tokens (multiples of P) or None. Token tiles are multiples
  of 8 (16 for 2-byte types) sublanes. Defaults: about 256 virtual query rows and 512
  virtual key rows, halved (keys first) until `vmem_estimate` fits `VMEM_BUDGET_BYTES`; tiles a
  caller gives are kept (the compiler then says whether they fit).
  """
  p = cfg.num_pseudo
  itemsize = jnp.dtype(dtype).itemsize
  user_q, user_k = _tokens("block_q", block_q, p), _tokens("block_k", block_k, p)
  sublanes = 8 * max(1, 4 // itemsize)
  for name, value in (("block_q", user_q), ("block_k", user_k)):
    if value is not None and value % sublanes:
      raise ValueError(
        f"TPU tiles must be multiples of {sublanes} tokens ({sublanes * p} virtual tokens at "
        f"P = {p}), got {name} = {value * p} virtual tokens."
      )
  n_min = round_up(n, sublanes)
  bq = min(user_q or max(sublanes, 256 // p // sublanes * sublanes), n_min)
  # Keys: as many tokens as the queries' padded tiles, or a sliced call's own keys.
  k_min = round_up(n_min, bq) if kv_tokens is None else round_up(kv_tokens, sublanes)
  bk = min(user_k or max(sublanes, 512 // p // sublanes * sublanes), k_min)
  fixed = dict(block_q=user_q is not None, block_k=user_k is not None)
  while True:
    if kv_tokens is None:
      lengths = dict(seq_len=round_up(n, math.lcm(bq, bk)))
    else:
      lengths = dict(seq_len=round_up(n, bq), kv_seq_len=round_up(kv_tokens, bk))
    cfg = dataclasses.replace(cfg, block_q=bq, block_k=bk, **lengths)
    if vmem_estimate(cfg, itemsize) <= VMEM_BUDGET_BYTES:
      return cfg
    if not fixed["block_k"] and bk >= bq and bk // 2 % sublanes == 0:
      bk //= 2
    elif not fixed["block_q"] and bq // 2 % sublanes == 0 and bq > sublanes:
      bq //= 2
    else:
      return cfg
