"""IHA and MHA through the flash kernels: pseudo-heads mixed by einsums in HBM
(`flash.mixing`: the `T = N * P` virtual rows each target head attends over), plain flash
attention on them (`flash.tpu`: Mosaic, `flash.gpu`: Triton; the kernels do no scaling),
and the P outputs collapsed by one more einsum.

RoPE at the virtual positions `pos * P + p`: on TPU, window layers and MHA at tiles under
1024 rows (bound by HBM) pass one float32 `cos | sin` table per side and the kernels
rotate q and k per tile in VMEM (and dq, dk back); global IHA layers (bound by the MXU)
and every GPU call rotate q and k here, in the einsums' float32 output.

The custom VJP keeps the source q, k, v, the mixing tensors, the pseudo output o and the
float32 log-sum-exp: pseudo q/k/v are remade in the backward (as cheap as in the forward),
o is saved rather than recomputed by a second forward pass (docs/performance.md §14). A
sequence shard's query offset reaches the kernels as a scalar operand, so one compiled
kernel serves every shard. `lax.platform_dependent` runs the compiled kernels when
lowering for their platform and Pallas' interpreter elsewhere (e.g. CPU), so `jax.export`
or a compile-only device (`iha_jax.parallel.targets`) gets the real kernels.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from iha_jax.core.options import AttentionOptions, round_up
from iha_jax.core.validation import default_positions
from iha_jax.kernels import gpu, tpu
from iha_jax.kernels.flash import gpu as flash_gpu
from iha_jax.kernels.flash import tpu as flash_tpu
from iha_jax.kernels.flash.mixing import Mixing, pseudo_per_head, virtual_segment_ids
from iha_jax.kernels.flash.plan import Call, Tiles

# Default TPU tiles (rows), the estimate's choice on v5p at the paper's shape
# (docs/performance.md): global layers amortise a step's fixed cost over 1024 x 1024
# pairs; a window's band wastes less of a 512-row tile (and 1024 x 1024 window backward
# kernels exceed the default scoped VMEM, as float32 ones would).
GLOBAL_BLOCK = 1024
WINDOW_BLOCK = 512
# Remat name of the kernels' residuals (o and its lse), given only while o has at most
# `SAVED_RESIDUAL_BYTES` per call and device, so that a policy naming it (`save_attention`)
# keeps them and the backward skips re-running the forward (docs/performance.md §14).
ATTENTION_RESIDUALS = "attention_residuals"
SAVED_RESIDUAL_BYTES = 2**29
# Past this much pseudo output o per device, forward and backward run over chunks of the
# batch, one after another (`_by_chunks`): pseudo q/k/v, o, do and their gradients are P
# times the layer's activations, and at the paper's P = 20 they set the step's peak memory.
CHUNK_BYTES = 2**30
# The chunks are unrolled, so a step's compile time grows with their count.
MAX_CHUNKS = 8

# Per platform: the flash calls, and how they run (compiled there, interpreted elsewhere).
_FLASH = {"tpu": flash_tpu, "gpu": flash_gpu}
_ON_PLATFORM = {"tpu": tpu.on_tpu, "gpu": gpu.on_gpu}
PLATFORMS = tuple(_FLASH)


def _gpu_blocks(dtype, head_dim: int) -> tuple[int, int]:
  """Default GPU tiles (rows): 128 query rows against 64-row key tiles, FlashAttention-2's
  shape for Hopper at d <= 128; 64 x 32 for wider rows (128 x 64 overflowed shared memory
  at d = 256); 64 x 16 for float32, whose dots run on the CUDA cores: the largest
  spill-free at d = 128 (docs/compile_checks.md)."""
  if jnp.dtype(dtype).itemsize >= 4:
    return 64, 16
  return (64, 32) if head_dim > 128 else (128, 64)


def _tile(rows: int, requested: int | None, default: int, name: str, platform: str):
  """(tile edge, padded rows): the requested or default edge, or one tile for a shorter
  sequence. TPU tiles are multiples of 16 rows (bf16 packs 16 rows per vreg), GPU tiles
  powers of two >= 16 (Triton's block shapes)."""
  if platform == "gpu":
    bad = requested is not None and (requested < gpu.MIN_BLOCK or requested & (requested - 1))
    rule, example, fit = f"powers of two >= {gpu.MIN_BLOCK} rows", 64, gpu.block_pow2(rows)
  else:
    unit = tpu.PACKED_SUBLANES
    bad = requested is not None and (requested <= 0 or requested % unit)
    rule, example, fit = f"positive multiples of {unit} rows", 512, round_up(rows, unit)
  if bad:
    raise ValueError(
      f"block_sizes.{name}={requested}: {platform.upper()} tiles are {rule} (virtual tokens "
      f"for IHA), e.g. {example}"
    )
  block = min(requested or default, fit)
  return block, round_up(rows, block)


def _run_flash(platform: str, name: str, call: Call, *args, **options):
  """`flash.<platform>.<name>(call, *args, **options)`: compiled on its platform (Mosaic
  on TPU, Triton on cuda/rocm), Pallas' interpreter elsewhere (e.g. CPU)."""
  return _ON_PLATFORM[platform](
    functools.partial(getattr(_FLASH[platform], name), call, **options), *args
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pipeline(platform, mixing, call, q, k, v, alphas, positions, key_positions, seg, offset):
  """Padded pseudo outputs `[B, Ht, rows_q, dv]` of mixing + flash attention."""
  # Not differentiated: no log-sum-exp to write (TPU; the GPU kernel writes it anyway).
  options = {"with_lse": False} if platform == "tpu" else {}
  args = (q, k, v, alphas, positions, key_positions, seg, offset)
  return _forward(platform, mixing, call, *args, **options)[0]


def _forward(platform, mixing, call, q, k, v, alphas, positions, key_positions, seg, offset, **kw):
  """Mixing, then the forward kernel (`kw`: its options), by chunks of the batch
  (`CHUNK_BYTES`): (o, lse or None)."""

  def forward(q, k, v, positions, key_positions, seg):
    qv, kv, vv = mixing(q, k, v, alphas, positions, key_positions)
    rope = mixing.tables(positions, key_positions, pseudo_per_head(alphas), q.shape[-1])
    return _run_flash(platform, "forward", call, qv, kv, vv, rope, seg, offset, **kw), ()

  chunks = _chunks(mixing, q, v, alphas)
  return _by_chunks(forward, chunks, q, k, v, positions, key_positions, seg)[0]


def _pipeline_fwd(platform, mixing, call, q, k, v, alphas, positions, key_positions, seg, offset):
  args = (q, k, v, alphas, positions, key_positions, seg, offset)
  o, lse = _forward(platform, mixing, call, *args)
  if o.size * o.dtype.itemsize <= SAVED_RESIDUAL_BYTES:
    o, lse = checkpoint_name(o, ATTENTION_RESIDUALS), checkpoint_name(lse, ATTENTION_RESIDUALS)
  # Saved: the source heads, not the P-times larger pseudo q/k/v (remade below).
  return o, (q, k, v, alphas, positions, key_positions, seg, offset, o, lse)


def _pipeline_bwd(platform, mixing, call, residuals, do):
  q, k, v, alphas, positions, key_positions, seg, offset, o, lse = residuals

  def backward(q, k, v, positions, key_positions, seg, o, lse, do):
    mix = lambda q, k, v, alphas: mixing(q, k, v, alphas, positions, key_positions)
    (qv, kv, vv), mix_vjp = jax.vjp(mix, q, k, v, alphas)
    rope = mixing.tables(positions, key_positions, pseudo_per_head(alphas), q.shape[-1])
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dqv, dkv, dvv = _run_flash(
      platform, "backward", call, qv, kv, vv, rope, seg, offset, do.astype(qv.dtype), lse, delta
    )
    dq, dk, dv, dalphas = mix_vjp((dqv, dkv, dvv))  # already in the pseudo rows' dtypes
    return (dq, dk, dv), dalphas

  chunks = _chunks(mixing, q, v, alphas)
  batched = (q, k, v, positions, key_positions, seg, o, lse, do)
  (dq, dk, dv), dalphas = _by_chunks(backward, chunks, *batched)
  return dq, dk, dv, dalphas, None, None, None, None


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)


def _chunks(mixing: Mixing, q: jax.Array, v: jax.Array, alphas) -> int:
  """Chunks of the batch the pipeline runs in: the fewest that divide it with at most
  `CHUNK_BYTES` of pseudo output o each, at most `MAX_CHUNKS` (the largest divisor up
  to it when none is small enough)."""
  b = q.shape[0]
  heads = q.shape[2] if alphas is None else alphas[0].shape[1]
  o_bytes = b * heads * mixing.rows_q * v.shape[-1] * q.dtype.itemsize
  divisors = [c for c in range(1, min(b, MAX_CHUNKS) + 1) if b % c == 0]
  return next((c for c in divisors if o_bytes <= c * CHUNK_BYTES), divisors[-1])


def _by_chunks(fn, chunks: int, *batched):
  """`fn(*batched) -> (joined, summed)` over `chunks` equal slices of the leading (batch)
  axis of every array of `batched` (pytrees; None passes), one after another: a chunk's
  inputs wait on the previous chunk's outputs (an optimization barrier), so one chunk's
  P-sized temporaries are live at a time; `joined` outputs are concatenated along the
  batch, `summed` ones (the mixing tensors' gradients) added up. Unrolled: a `lax.map`
  loop raised the P = 20 step's peak memory (its body's buffers were not shared;
  docs/performance.md §14)."""
  if chunks == 1:
    return fn(*batched)
  size = jax.tree.leaves(batched)[0].shape[0] // chunks
  outputs = []
  for c in range(chunks):
    part = jax.tree.map(lambda x, c=c: x[c * size : (c + 1) * size], batched)
    if outputs:  # (both used after it: XLA on GPU pruned a barrier's unused operand)
      outputs[-1], part = lax.optimization_barrier((outputs[-1], part))
    outputs.append(fn(*part))
  joined = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[out[0] for out in outputs])
  return joined, jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *[out[1] for out in outputs])


def _plan_call(q, k, v, alphas, options: AttentionOptions, platform: str):
  """The policy of a call: its tiles (the platform's defaults or `options.block_sizes`),
  where RoPE runs (kernels or HBM), and with them the static `Call` and `Mixing`."""
  _, n, _, d = q.shape
  nk = k.shape[1]
  sliced = options.sliced or nk != n
  p = pseudo_per_head(alphas)
  if platform == "gpu":
    default_q, default_k = _gpu_blocks(q.dtype, d)
  else:
    # float32 tiles, or rows over 128 lanes (differential attention's dv = 2d), take twice
    # the VMEM: those global layers fall back to the window's tiles (1024-row dK/dV tiles
    # at dv = 256 exceed v5p's 16 MiB of scoped VMEM).
    wide = (
      options.window is None
      and jnp.dtype(q.dtype).itemsize <= 2
      and max(d, v.shape[-1]) <= tpu.LANES
    )
    default_q = default_k = GLOBAL_BLOCK if wide else WINDOW_BLOCK
  blocks = options.block_sizes
  block_q, rows_q = _tile(n * p, blocks and blocks.block_q, default_q, "block_q", platform)
  block_k, rows_k = _tile(nk * p, blocks and blocks.block_k, default_k, "block_k", platform)
  offset = options.query_offset if sliced else 0
  tiles = Tiles(
    block_q=block_q,
    block_k=block_k,
    num_q=rows_q // block_q,
    num_k=rows_k // block_k,
    keys=nk * p,
    causal=options.causal,
    window=options.window,
    offset=offset * p if isinstance(offset, int) else None,
    max_offset=nk * p,
  )
  key_ids = options.key_segment_ids if sliced else options.segment_ids
  segments = options.segment_ids is not None or (sliced and key_ids is not None)
  heads = q.shape[2] if alphas is None else alphas[0].shape[1]
  kv_heads = k.shape[2] if alphas is None else alphas[1].shape[1]
  # RoPE in the kernels where they are bound by HBM (the module docstring); not with
  # 1024-row tiles, whose float32 tables left MHA's dK/dV no VMEM headroom at N = 65536.
  in_kernel = (
    platform == "tpu"
    and options.rope_theta is not None
    and (options.window is not None or (alphas is None and max(block_q, block_k) < GLOBAL_BLOCK))
  )
  call = Call(tiles, heads=heads, kv_heads=kv_heads, segments=segments, rotary=in_kernel)
  return call, Mixing(options.rope_theta, 1 / math.sqrt(d), rows_q, rows_k, in_kernel)


def _pseudo_outputs(q, k, v, alphas, options: AttentionOptions, platform: str) -> jax.Array:
  """Pseudo outputs `[B, Ht, N, P, dv]` (q.dtype) of mixing + flash attention on
  `platform`; arguments as `iha`'s (`alphas` None for MHA, P = 1)."""
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}: the kernels' platforms are {PLATFORMS}")
  b, n, _, _ = q.shape
  nk = k.shape[1]
  sliced = options.sliced or nk != n
  p = pseudo_per_head(alphas)
  call, mixing = _plan_call(q, k, v, alphas, options, platform)
  positions = default_positions(q, options.positions)
  key_positions = positions
  key_ids = options.segment_ids
  if sliced:
    key_ids, key_positions = options.key_segment_ids, options.key_positions
    if key_positions is None:
      key_positions = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
  seg = None
  if call.segments:
    query_ids = options.segment_ids
    if query_ids is None:
      query_ids = jnp.ones((b, n), jnp.int32)
    if key_ids is None:
      key_ids = jnp.ones((b, nk), jnp.int32)
    key_ids = jnp.where(key_ids == 0, -1, key_ids)  # padding keys: seen by no query
    block_k = call.tiles.block_k
    seg = (  # query ids as columns [B, Tq, 1], key ids as rows of a tile [B, tiles, 1, bk]
      virtual_segment_ids(query_ids, p, mixing.rows_q, 0)[..., None],
      virtual_segment_ids(key_ids, p, mixing.rows_k, -1).reshape(
        b, mixing.rows_k // block_k, 1, block_k
      ),
    )
  offset = options.query_offset if sliced else 0
  static = isinstance(offset, int)
  offset_operand = None if static else (jnp.asarray(offset, jnp.int32) * p).reshape(1)
  args = (q, k, v, alphas, positions, key_positions, seg, offset_operand)
  o = _pipeline(platform, mixing, call, *args)
  return o[:, :, : n * p].reshape(b, call.heads, n, p, v.shape[-1])


def iha(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  options: AttentionOptions,
  *,
  platform: str,
) -> jax.Array:
  """IHA (docs/design.md §1.2-1.6) through the flash kernels of `platform` ("tpu",
  "gpu") -> `[B, N, H', d]` float32: H' = H for a full collapse `[H, Ht, P]` (a partial
  sum over the Ht local target heads computed here: all, or a head shard's), Ht for
  per_head `[Ht, P]`.

  q `[B, N, H, d]`, k and v `[B, Nk, G, d]` source heads (Nk = N unless a sequence shard;
  G < H is grouped-query attention); `alphas = (alpha_q [H, Ht, P], alpha_k [G, Gt, P],
  alpha_v [G, Gt, P])`; `options` as `iha_jax.ops.iha_attention` checks them (its
  `implementation` is not read). The kernel behind `implementation="pallas_<platform>"`
  without the checks or the mesh routing (`iha_jax.kernels.sharded`)."""
  o = _pseudo_outputs(q, k, v, alphas, options, platform)
  spec = "bgnpd,hgp->bnhd" if collapse.ndim == 3 else "bhnpd,hp->bnhd"
  return jnp.einsum(spec, o, collapse.astype(o.dtype), preferred_element_type=jnp.float32)


def mha(
  q: jax.Array, k: jax.Array, v: jax.Array, options: AttentionOptions, *, platform: str
) -> jax.Array:
  """MHA (causal or bidirectional) through the same flash kernels without mixing (P = 1):
  q `[B, N, H, d]`, k `[B, Nk, G, d]` (RoPE applies to these), v `[B, Nk, G, dv]` (dv may
  differ from d, e.g. 2d for differential attention) -> `[B, N, H, dv]` in q's dtype."""
  o = _pseudo_outputs(q, k, v, None, options, platform)
  return jnp.swapaxes(o[:, :, :, 0], 1, 2).astype(q.dtype)
