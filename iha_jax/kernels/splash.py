"""Multi-head attention on jax's splash attention kernel (TPU), this project's conventions.

`splash_mha_attention(q, k, v, options)` computes what `mha_attention` does (RoPE, scale
`1/sqrt(d)`, causal or bidirectional, a window, packed segments, grouped-query heads) with
`jax.experimental.pallas.ops.tpu.splash_attention`; IHA runs on it through materialised
pseudo q/k/v over the `N * P` virtual tokens (`iha_jax.core.attention.iha_via_mha`).
Conventions mapped onto splash's: static masks (`CausalMask`, `LocalMask` with
`window_size = (window - 1, 0)` causal or `(window - 1, window - 1)`, `FullMask`); padding
(id 0) queries output zeros here (splash lets them attend to padding keys); sequences
padded to whole blocks (causal padding keys come after every real query, bidirectional
ones get id 0); sequence shards refused (splash's masks are static, a shard's offset is
traced: run those layers with "pallas_tpu").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from iha_jax.core.options import AttentionOptions, round_up
from iha_jax.core.rope import apply_rope
from iha_jax.core.validation import default_positions
from iha_jax.kernels.tpu import LANES, on_tpu

DEFAULT_BLOCK = 512  # without `block_sizes` (benchmarks search per shape: performance.md)
# Splash's compute block (the key block one inner step multiplies) at most this: larger
# ones exceed v5p's scoped VMEM with 2048-row query blocks.
COMPUTE_BLOCK = 512


def block_size(seq_len: int, requested: int | None = None) -> int:
  """A splash block for a `seq_len`-long sequence: `requested` (rounded up to the lane
  width) or the default, never beyond the padded sequence."""
  block = round_up(requested or DEFAULT_BLOCK, LANES)
  return min(block, round_up(seq_len, LANES))


def _mask(seq_len: int, window: int | None, causal: bool):
  shape = (seq_len, seq_len)
  if window is not None:
    reach = (window - 1, 0 if causal else window - 1)
    return splash.LocalMask(shape, window_size=reach, offset=0)
  return splash.CausalMask(shape) if causal else splash.FullMask(shape)


def block_sizes(block_q: int, block_kv: int) -> splash.BlockSizes:
  """Splash's blocks from a query and a key block: the forward's as given, its compute
  block at most `COMPUTE_BLOCK`; the backward's query blocks at most the key block."""
  compute = min(block_kv, COMPUTE_BLOCK)
  backward_q = min(block_q, block_kv)
  return splash.BlockSizes(
    block_q=block_q,
    block_kv=block_kv,
    block_kv_compute=compute,
    block_q_dkv=backward_q,
    block_kv_dkv=block_kv,
    block_kv_dkv_compute=compute,
    block_q_dq=backward_q,
    block_kv_dq=block_kv,
  )


def _kernel(heads: int, seq_len: int, window, causal: bool, blocks, interpret: bool):
  """A splash kernel for one example `[H, T, d]` (vmapped over the batch); `blocks`:
  (query block, key block)."""
  # One mask object for every head: splash processes identical masks once.
  mask = splash.MultiHeadMask([_mask(seq_len, window, causal)] * heads)
  sizes = block_sizes(*blocks)
  return splash.make_splash_mha(
    mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
  )


def splash_mha_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, options: AttentionOptions, *, platform: str = "tpu"
) -> jax.Array:
  """q `[B, N, H, d]`, k `[B, N, G, d]`, v `[B, N, G, dv]` -> `[B, N, H, dv]` in q.dtype;
  `options` checked and defaulted (`block_sizes`: splash's query and key blocks);
  `platform` (the registry's uniform call) is not read."""
  del platform
  if options.sliced:
    raise ValueError(
      "implementation 'splash' cannot run a sequence shard (a query offset into longer "
      "keys; splash's masks are static): use 'pallas_tpu' under a 'context' mesh axis"
    )
  b, n, h, d = q.shape
  dtype = q.dtype
  if options.rope_theta is not None:
    positions = default_positions(q, options.positions)
    q = apply_rope(q, positions, options.rope_theta).astype(dtype)
    k = apply_rope(k, positions, options.rope_theta).astype(dtype)
  q = (q.astype(jnp.float32) / math.sqrt(d)).astype(dtype)
  requested = options.block_sizes or None
  blocks = (
    block_size(n, requested and requested.block_q),
    block_size(n, requested and (requested.block_k or requested.block_q)),
  )
  padded = round_up(n, math.lcm(*blocks))
  segment_ids = options.segment_ids
  if segment_ids is None and padded != n and not options.causal:
    segment_ids = jnp.ones((b, n), jnp.int32)  # padding keys get id 0 below
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - n)] + [(0, 0)] * (x.ndim - 2))
  heads_major = lambda x: jnp.swapaxes(pad(x), 1, 2)  # [B, H, T, d]
  args = [heads_major(q), heads_major(k), heads_major(v)]
  if segment_ids is not None:
    args.append(pad(segment_ids.astype(jnp.int32)))

  def run(*arrays, interpret: bool):
    kernel = _kernel(h, padded, options.window, options.causal, blocks, interpret)

    def one(q, k, v, ids=None):
      return kernel(q, k, v, segment_ids=None if ids is None else splash.SegmentIds(ids, ids))

    return jax.vmap(one)(*arrays)

  out = on_tpu(run, *args)
  out = jnp.swapaxes(out, 1, 2)[:, :n].astype(dtype)  # [B, N, H, dv]
  if options.segment_ids is not None:  # padding queries output zeros
    out = jnp.where((options.segment_ids != 0)[:, :, None, None], out, jnp.zeros((), dtype))
  return out
