"""The fused kernels under a mesh: batch over data axes, target heads over a tensor axis.

Mixing contracts over SOURCE heads, so every shard needs all H source heads of
q, k, v: their in_specs replicate the head axis (shard_map all-gathers a
head-sharded q/k/v across `head_axis`), while alpha_* are split along their
target axis, so a shard computes only its target heads from all source heads.
Full collapse then sums over every target head (a psum over `head_axis`);
per_head collapse stays local and the output keeps its head sharding.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from iha_jax.kernels import fused
from iha_jax.ops.options import BlockSizes


def sharded_iha_attention(q: jax.Array, k: jax.Array, v: jax.Array, alpha_q: jax.Array,
                          alpha_k: jax.Array, alpha_v: jax.Array, collapse: jax.Array, *,
                          mesh: Mesh, batch_axes: Sequence[str] = ("data",),
                          head_axis: str = "tensor", window: int | None = None,
                          segment_ids: jax.Array | None = None,
                          positions: jax.Array | None = None,
                          rope_theta: float | None = 10000.0, causal: bool = True,
                          platform: str = "gpu",
                          block_sizes: BlockSizes | None = None) -> jax.Array:
  """`iha_attention` (fused kernels) via `jax.shard_map` over `mesh`.

  Args:
    q, k, v: `[B, N, H, d]`; B divisible by the product of `batch_axes` sizes.
    alpha_q, alpha_k, alpha_v: `[H, H, P]`; H divisible by the `head_axis` size.
    collapse: `[H, H, P]` (full) or `[H, P]` (per_head).
    mesh: device mesh holding `batch_axes` and `head_axis`.
    window, segment_ids, positions, rope_theta, causal, platform, block_sizes: as
      `iha_jax.kernels.iha_attention` (ids/positions `[B, N]`, default filled here).

  Returns:
    `[B, N, H, d]`: batch-sharded; per_head collapse also head-sharded.
  """
  b, n = q.shape[:2]
  if segment_ids is None:
    segment_ids = jnp.ones((b, n), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  batch = tuple(batch_axes)
  full = collapse.ndim == 3

  def local(q, k, v, alpha_q, alpha_k, alpha_v, collapse, segment_ids, positions):
    y, restore = fused.collapsed_outputs(q, k, v, (alpha_q, alpha_k, alpha_v), collapse,
                                         window=window, segment_ids=segment_ids,
                                         positions=positions, rope_theta=rope_theta,
                                         causal=causal, platform=platform,
                                         block_sizes=block_sizes)
    if full:  # every output head mixes every target head: sum the shards' shares
      y = jax.lax.psum(y, head_axis)
    return restore(y).astype(q.dtype)

  source = P(batch, None, None, None)
  alpha = P(None, head_axis, None)
  tokens = P(batch, None)
  in_specs = (source, source, source, alpha, alpha, alpha,
              alpha if full else P(head_axis, None), tokens, tokens)
  args = (q, k, v, alpha_q, alpha_k, alpha_v, collapse, segment_ids, positions)
  # Explicit-axis meshes (jax.make_mesh's default) want inputs laid out as in_specs;
  # Auto axes are resharded by shard_map itself.
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if all(types[axis] == AxisType.Explicit for axis in (*batch, head_axis)):
    args = [jax.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(args, in_specs)]
  return jax.shard_map(
      local, mesh=mesh, in_specs=in_specs,
      out_specs=source if full else P(batch, None, head_axis, None),
      # pallas_call carries no varying-manual-axes types.
      check_vma=False,
  )(*args)
