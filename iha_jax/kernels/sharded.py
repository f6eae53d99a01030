"""The Pallas kernels under a mesh: batch over data axes, heads over a tensor axis.

A `pallas_call` has no partitioning rule: called on sharded operands, XLA would gather
them whole onto every device. These wrappers run the kernels inside `jax.shard_map`,
so each device attends over its own rows (and heads) only.

- MHA (`sharded_mha_attention`): q, k, v and the output are split over batch and heads.
- IHA (`sharded_iha_attention`): mixing contracts over SOURCE heads, so every shard
  needs all H source heads of q, k, v: their in_specs replicate the head axis
  (shard_map all-gathers a head-sharded q/k/v across `head_axis`, `[B, N, H, d]`: the
  small tensors), while alpha_* are split along their target axis, so a shard computes
  only its target heads' pseudo-heads. Full collapse then sums over every target head
  (a psum over `head_axis`); per_head collapse stays local and keeps the head sharding.
- Sliced calls (a sequence shard inside `iha_jax.parallel.context`'s shard_map over
  `context`: keys `[B, Nk, G, d]` longer than the queries, `query_offset`,
  `kv_segment_ids`, `kv_positions`): the key-side ids and positions are split over the
  batch axes like q's, a traced query offset (a scalar) is replicated to every shard.
- Grouped-query (k, v with G < H heads): MHA splits k and v over `head_axis` like q, IHA
  splits alpha_k, alpha_v along their key/value target axis like alpha_q; with G divisible
  by the axis size, shard s holds query heads `[s H/t, (s+1) H/t)` and exactly the key/value
  heads they read, so groups never straddle shards.

`mesh=None` takes the mesh made current by `jax.set_mesh` (`iha_jax.parallel.activate`);
`batch_axes` / `head_axis` name its axes (`()` / None: not split; by default the ones the
logical-axis rules give the batch and the heads, `iha_jax.parallel.sharding.kernel_axes`).

`iha_on_current_mesh` / `mha_on_current_mesh` are what the kind records name for
"pallas_tpu" / "pallas_gpu": under a mesh they run the wrappers with the axes the
logical-axis rules give (`iha_jax.parallel.sharding.kernel_axes`), else the kernels
directly, so a layer makes one call whatever the mesh.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from iha_jax.core.options import AttentionOptions, with_overrides
from iha_jax.core.validation import default_positions
from iha_jax.kernels import splash
from iha_jax.kernels.flash import attention
from iha_jax.kernels.window import gpu as gpu_window
from iha_jax.kernels.window import tpu as tpu_window
from iha_jax.kernels.window.common import key_side
from iha_jax.parallel import sharding

MeshLike = Mesh | AbstractMesh


class _Axes(enum.Enum):
  FROM_RULES = "the logical-axis rules' batch / head axes of the mesh"


# The default of `batch_axes` and `head_axis`: the mesh axes the logical-axis rules map the
# batch and the heads to (`iha_jax.parallel.sharding.kernel_axes`, as the kernel entries).
FROM_RULES = _Axes.FROM_RULES


def _current(mesh: MeshLike | None) -> MeshLike:
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    raise ValueError("no mesh: pass mesh= or call under jax.set_mesh / iha_jax.parallel.activate")
  return mesh


def check_divisible(
  mesh: MeshLike,
  batch: int,
  heads: int,
  batch_axes: Sequence[str],
  head_axis: str | None,
  kv_heads: int | None = None,
) -> None:
  """Batch, head and key/value head counts must split evenly over their mesh axes (named
  in the error)."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  for axis in (*batch_axes, *([head_axis] if head_axis else [])):
    if axis not in sizes:
      raise ValueError(f"mesh axis {axis!r} does not exist; the mesh has {tuple(sizes)}")
  shards = math.prod(sizes[a] for a in batch_axes)
  if batch % shards:
    raise ValueError(
      f"batch B={batch} is not divisible by the mesh axes {tuple(batch_axes)} "
      f"(size {shards}); use a batch that is a multiple of {shards}"
    )
  if head_axis and heads % sizes[head_axis]:
    raise ValueError(
      f"num_heads H={heads} is not divisible by mesh axis {head_axis!r} "
      f"(size {sizes[head_axis]}); use H a multiple of it"
    )
  if head_axis and kv_heads is not None and _kv_split(kv_heads, sizes[head_axis]) is None:
    raise ValueError(
      f"num_kv_heads G={kv_heads} and mesh axis {head_axis!r} (size {sizes[head_axis]}): "
      "tensor parallelism splits the key/value heads when the axis divides G, or keeps "
      "them whole when G divides the axis; use sizes where one divides the other"
    )


def _kv_split(kv_heads: int, shards: int) -> bool | None:
  """Whether a head axis of `shards` splits the G key/value heads (True), keeps them whole
  on every shard (False: G divides the axis, each shard's query heads read one of them), or
  cannot place them (None)."""
  if kv_heads % shards == 0:
    return True
  if shards % kv_heads == 0:
    return False
  return None


def _kv_placement(k: jax.Array, mesh: MeshLike, head_axis: str | None) -> tuple[int, int, bool]:
  """`(G, shards of the head axis, whether they split the G key/value heads)` for
  `k: [B, N, G, d]` (`_kv_split`; `check_divisible` has refused a G it cannot place)."""
  shards = dict(zip(mesh.axis_names, mesh.axis_sizes))[head_axis] if head_axis else 1
  return k.shape[2], shards, bool(_kv_split(k.shape[2], shards))


def _local_kv(x: jax.Array, axis: int, head_axis: str, kv_heads: int, shards: int) -> jax.Array:
  """The one key/value head (along `axis` of `x`) this shard's query heads read, when the
  G heads are kept whole on a head axis of `shards` > G (consecutive shards share one)."""
  index = jax.lax.axis_index(head_axis) // (shards // kv_heads)
  return jax.lax.dynamic_slice_in_dim(x, index, 1, axis=axis)


def _shard_map(
  local: Callable, mesh: MeshLike, in_specs: tuple, out_specs: P, args: Sequence[jax.Array]
) -> jax.Array:
  axes = {
    a
    for spec in in_specs
    for entry in spec
    if entry
    for a in ((entry,) if isinstance(entry, str) else entry)
  }
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  # Explicit-axis meshes (jax.make_mesh's default) want inputs laid out as in_specs;
  # Auto axes are resharded by shard_map itself.
  if axes and all(types[axis] == AxisType.Explicit for axis in axes):
    args = [jax.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(args, in_specs)]
  # pallas_call carries no varying-manual-axes types: check_vma off.
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
    *args
  )


class _Tokens:
  """A sharded call's token arrays and their in_specs: `[B, N]` query ids and positions,
  and, for a sliced call, `[B, Nk]` key ids and positions and a traced query offset (the
  kernels fill defaults themselves, but shard_map needs an array per in_spec; a static
  offset stays a Python int, closed over)."""

  def __init__(self, q: jax.Array, k: jax.Array, options: AttentionOptions, batch: tuple):
    segment_ids = options.segment_ids
    if segment_ids is None:
      segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    self.arrays = [segment_ids, default_positions(q, options.positions)]
    self.specs = [P(batch, None)] * 2
    self.sliced = options.sliced or k.shape[1] != q.shape[1]
    self.offset = options.query_offset
    if self.sliced:
      self.arrays += list(key_side(q, k, options))
      self.specs += [P(batch, None)] * 2
      if not isinstance(self.offset, int):
        self.arrays.append(jnp.asarray(self.offset, jnp.int32))
        self.specs.append(P())

  def options(self, options: AttentionOptions, arrays: Sequence[jax.Array]) -> AttentionOptions:
    """`options` with this shard's token arrays (`arrays`: the local `self.arrays`)."""
    local = dict(segment_ids=arrays[0], positions=arrays[1])
    if self.sliced:
      local.update(kv_segment_ids=arrays[2], kv_positions=arrays[3])
      local["query_offset"] = self.offset if isinstance(self.offset, int) else arrays[4]
    return options.replace(**local)


def _prepare(
  q: jax.Array,
  k: jax.Array,
  mesh: MeshLike | None,
  batch_axes: Sequence[str] | _Axes,
  head_axis: str | None | _Axes,
  options: AttentionOptions,
) -> tuple[MeshLike, tuple[str, ...], str | None, _Tokens]:
  """The mesh, batch axes, head axis (`FROM_RULES`: the rules') and token arrays of a
  sharded call."""
  mesh = _current(mesh)
  if batch_axes is FROM_RULES or head_axis is FROM_RULES:
    rules = sharding.kernel_axes(mesh) or dict(batch_axes=(), head_axis=None)
    batch_axes = rules["batch_axes"] if batch_axes is FROM_RULES else batch_axes
    head_axis = rules["head_axis"] if head_axis is FROM_RULES else head_axis
  batch = tuple(batch_axes)
  check_divisible(mesh, q.shape[0], q.shape[2], batch, head_axis, kv_heads=k.shape[2])
  return mesh, batch, head_axis, _Tokens(q, k, options, batch)


def sharded_iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  options: AttentionOptions | None = None,
  *,
  mesh: MeshLike | None = None,
  batch_axes: Sequence[str] | _Axes = FROM_RULES,
  head_axis: str | None | _Axes = FROM_RULES,
  platform: str = "gpu",
  kernel: Callable[..., jax.Array] | None = None,
  **overrides: Any,
) -> jax.Array:
  """IHA's kernels via `jax.shard_map` over `mesh`: `kernel` (default
  `flash.attention.iha`; e.g. the on-chip window path's) on each shard.

  Args:
    q: `[B, N, H, d]`, k, v: `[B, N, G, d]` (`[B, Nk, G, d]` for a sliced call); B
      divisible by the product of `batch_axes` sizes.
    alpha_q: `[H, H, P]`, alpha_k, alpha_v: `[G, G, P]`; H and G divisible by the
      `head_axis` size (each shard computes its query targets and their key/value
      targets: grouped-query groups never straddle shards).
    collapse: `[H, H, P]` (full) or `[H, P]` (per_head).
    options, **overrides: `AttentionOptions` (ids / positions `[B, N]`, a sliced call's
      `kv_*` `[B, Nk]` and `query_offset`; defaults filled here); `implementation` is
      not read: the kernels of `platform` run.
    mesh: device mesh holding `batch_axes` and `head_axis` (None: the current mesh).
    batch_axes, head_axis: the mesh axes the batch and the heads split over (`()` / None:
      not split); `FROM_RULES`: those the logical-axis rules give them.

  Returns:
    `[B, N, H, d]`: batch-sharded; per_head collapse also head-sharded.
  """
  options = with_overrides(options, overrides)
  mesh, batch, head_axis, tokens = _prepare(q, k, mesh, batch_axes, head_axis, options)
  full = collapse.ndim == 3
  g, shards, split_kv = _kv_placement(k, mesh, head_axis)

  def local(q, k, v, alpha_q, alpha_k, alpha_v, collapse, *token_arrays):
    local_options = tokens.options(options, token_arrays)
    if not split_kv:  # all G target heads here: keep the one this shard's queries read
      alpha_k, alpha_v = (_local_kv(a, 1, head_axis, g, shards) for a in (alpha_k, alpha_v))
    y = (kernel or attention.iha)(
      q, k, v, (alpha_q, alpha_k, alpha_v), collapse, local_options, platform=platform
    )
    if full and head_axis:  # every output head mixes every target head: sum the shares
      y = jax.lax.psum(y, head_axis)
    return y.astype(q.dtype)

  source = P(batch, None, None, None)
  alpha = P(None, head_axis, None)
  kv_alpha = alpha if split_kv else P(None, None, None)
  in_specs = (
    source,
    source,
    source,
    alpha,
    kv_alpha,
    kv_alpha,
    alpha if full else P(head_axis, None),
    *tokens.specs,
  )
  out_specs = source if full else P(batch, None, head_axis, None)
  return _shard_map(
    local, mesh, in_specs, out_specs, (q, k, v, alpha_q, alpha_k, alpha_v, collapse, *tokens.arrays)
  )


def sharded_mha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  options: AttentionOptions | None = None,
  *,
  mesh: MeshLike | None = None,
  batch_axes: Sequence[str] | _Axes = FROM_RULES,
  head_axis: str | None | _Axes = FROM_RULES,
  platform: str = "gpu",
  kernel: Callable[..., jax.Array] = attention.mha,
  **overrides: Any,
) -> jax.Array:
  """`kernel` (`flash.attention.mha`, or `splash.splash_mha_attention`) via
  `jax.shard_map`: heads are independent, so q
  `[B, N, H, d]`, k, v `[B, N, G, dv]` and the output stay split over batch and heads (G
  divisible by the `head_axis` size: each shard holds whole grouped-query groups).

  Args and returns as `sharded_iha_attention` without the mixing; `[B, N, H, dv]`.
  """
  options = with_overrides(options, overrides)
  mesh, batch, head_axis, tokens = _prepare(q, k, mesh, batch_axes, head_axis, options)
  g, shards, split_kv = _kv_placement(k, mesh, head_axis)

  def local(q, k, v, *token_arrays):
    if not split_kv:  # all G heads here: keep the one this shard's queries read
      k, v = (_local_kv(x, 2, head_axis, g, shards) for x in (k, v))
    return kernel(q, k, v, tokens.options(options, token_arrays), platform=platform)

  heads = P(batch, None, head_axis, None)
  kv = heads if split_kv else P(batch, None, None, None)
  return _shard_map(local, mesh, (heads, kv, kv, *tokens.specs), heads, (q, k, v, *tokens.arrays))


def _on_current_mesh(direct: Callable, wrapped: Callable, *args: Any, platform: str) -> jax.Array:
  """`wrapped(*args)` over the current mesh's kernel axes when a mesh is set (and not
  all manual), else `direct(*args)`; args: the arrays, then the `AttentionOptions`."""
  axes = sharding.kernel_axes(jax.sharding.get_abstract_mesh())
  if axes is None:
    return direct(*args, platform=platform)
  return wrapped(*args, platform=platform, **axes)


def _unsharded(outputs: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """An IHA pipeline's `outputs(q, k, v, alphas, collapse, options, platform=)` (float32)
  as a direct call with the alphas apart, in q's dtype: the no-mesh branch."""

  def call(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options, *, platform: str):
    alphas = (alpha_q, alpha_k, alpha_v)
    return outputs(q, k, v, alphas, collapse, options, platform=platform).astype(q.dtype)

  return call


# The on-chip window paths, by platform (same signature and semantics).
_WINDOW_PATHS = {"tpu": tpu_window, "gpu": gpu_window}


def _window_outputs(q, k, v, alphas, collapse, options, *, platform: str) -> jax.Array:
  return _WINDOW_PATHS[platform].window_iha(q, k, v, alphas, collapse, options)


# The registry's kernel entries: one call, whatever the mesh.
iha_on_current_mesh = functools.partial(
  _on_current_mesh, _unsharded(attention.iha), sharded_iha_attention
)
mha_on_current_mesh = functools.partial(_on_current_mesh, attention.mha, sharded_mha_attention)
# IHA's on-chip window path (TPU): pseudo-heads made and collapsed in VMEM.
iha_window_on_current_mesh = functools.partial(
  _on_current_mesh,
  _unsharded(_window_outputs),
  functools.partial(sharded_iha_attention, kernel=_window_outputs),
  platform="tpu",
)
# Its GPU twin (Triton): pseudo-heads made and collapsed in registers and shared memory.
iha_gpu_window_on_current_mesh = functools.partial(
  _on_current_mesh,
  _unsharded(_window_outputs),
  functools.partial(sharded_iha_attention, kernel=_window_outputs),
  platform="gpu",
)
# jax's splash attention (TPU), under shard_map on a mesh like the kernels above.
splash_on_current_mesh = functools.partial(
  _on_current_mesh,
  splash.splash_mha_attention,
  functools.partial(sharded_mha_attention, kernel=splash.splash_mha_attention),
  platform="tpu",
)
