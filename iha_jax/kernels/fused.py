"""Pallas IHA / MHA attention on source heads: the entry points of both platforms.

q `[B, N, H, d]`, k and v `[B, N, G, d]` source heads and the mixing tensors
(`alpha_q: [H, Ht, P]`, `alpha_k, alpha_v: [G, Gt, P]`) go to
`iha_jax.kernels.virtual_attention`: pseudo q/k/v made once per call by einsums in HBM
(RoPE at the virtual positions `pos * P + p`, the softmax scale on the queries), flash
attention over the N*P virtual rows of each target head (TPU: Mosaic,
`iha_jax.kernels.tpu_flash`; GPU: Triton, `iha_jax.kernels.gpu_flash`), and the collapse
by one more einsum. G < H is grouped-query attention (query head h reads key/value head
`h // (H // G)`). Attention is causal or bidirectional (`causal=False`), global or
windowed, with the mask of `iha_jax.core.masking.visible` on virtual indices;
`fused_mha_attention`'s v may be wider than q and k (`[B, N, G, dv]`, e.g. dv = 2d for
differential attention).
Sequence shards (`AttentionOptions.sliced`, as `iha_jax.parallel.context` calls it): k and
v may hold `Nk != N` tokens with their own `kv_segment_ids` and `kv_positions` (keys
rotate at their own positions), and `query_offset` (an int or a traced int32 scalar)
places the queries on the keys' sequence; it reaches the kernels as a `[1]` int32
operand, so every shard runs one compiled kernel.
What the custom VJP saves: the source heads and mixing tensors (pseudo q/k/v are remade
by the einsums in the backward), the pseudo output and the float32 log-sum-exp
(`virtual_attention`).

Where the kernels run: `lax.platform_dependent` picks the compiled kernel when
lowering for its platform (TPU: Mosaic; cuda/rocm: Triton) and the same kernel
in Pallas interpret mode for any other platform (e.g. CPU), so
`implementation="pallas_gpu"` works everywhere, and `jax.export` or a compile-only
device (`iha_jax.parallel.targets`) for "tpu" or "cuda" gets the real kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.core.options import AttentionOptions
from iha_jax.kernels import virtual_attention

PLATFORMS = ("tpu", "gpu")


def _checked(platform: str) -> str:
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}: the kernels' platforms are {PLATFORMS}")
  return platform


def key_side(q: jax.Array, k: jax.Array, options: AttentionOptions) -> tuple[jax.Array, jax.Array]:
  """A sliced call's key segment ids and positions `[B, Nk]`: the options' own, else the
  queries' (keys of the queries' length), else one unpadded sequence `arange(Nk)`."""
  b, nk = k.shape[:2]
  segment_ids, positions = options.key_segment_ids, options.key_positions
  if nk != q.shape[1]:
    if options.kv_segment_ids is None and options.segment_ids is not None:
      raise ValueError(
        f"keys of {nk} tokens for {q.shape[1]} queries need kv_segment_ids [B, {nk}] "
        "when segment_ids are given"
      )
    segment_ids, positions = options.kv_segment_ids, options.kv_positions
  if segment_ids is None:
    segment_ids = jnp.ones((b, nk), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
  return segment_ids, positions


def collapsed_outputs(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  options: AttentionOptions,
  *,
  platform: str,
) -> jax.Array:
  """Attention and collapse of the local target heads -> `[B, N, H', d]` float32 (H' = H
  for a full `[H, Ht, P]` collapse: a partial sum over the local target heads; H' = Ht for
  per_head `[Ht, P]`). Arguments as `fused_iha_attention`'s, the alphas as one tuple."""
  return virtual_attention.collapsed(q, k, v, alphas, collapse, options, _checked(platform))


def fused_iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  options: AttentionOptions,
  *,
  platform: str,
) -> jax.Array:
  """IHA core (docs/design.md §1.2-1.6) on source heads q `[B, N, H, d]`, k and v
  `[B, N, G, d]` (`[B, Nk, G, d]` for a sequence shard) -> `[B, N, H, d]`.

  `alpha_q: [H, Ht, P]` (all H source heads of q feed the Ht target heads computed here:
  Ht = H, or a head shard), `alpha_k, alpha_v: [G, Gt, P]`; `options`: window, causal,
  RoPE, segment ids (None: one unpadded sequence per row), positions, tiles and a sliced
  call's fields; its `implementation` is not read (the platform is `platform`). The
  kernel behind `iha_jax.ops.iha_attention(implementation="pallas_<platform>")` without
  its checks or mesh routing.
  """
  y = collapsed_outputs(q, k, v, (alpha_q, alpha_k, alpha_v), collapse, options, platform=platform)
  return y.astype(q.dtype)


def fused_mha_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, options: AttentionOptions, *, platform: str
) -> jax.Array:
  """MHA (causal or bidirectional) through the same flash kernels without mixing (P = 1).

  q `[B, N, H, d]`, k `[B, N, G, d]` (RoPE applies to these), v `[B, N, G, dv]` (dv may
  differ from d, e.g. 2d for differential attention) -> `[B, N, H, dv]`; G divides H. A
  sequence shard's k, v hold Nk tokens.
  """
  return virtual_attention.mha(q, k, v, options, _checked(platform)).astype(q.dtype)
