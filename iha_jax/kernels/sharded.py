"""The Pallas kernels under a mesh: batch over data axes, heads over a tensor axis.

A `pallas_call` has no partitioning rule (on sharded operands XLA would gather them whole
onto every device), so these wrappers run the kernels inside `jax.shard_map`:
- MHA (`sharded_mha_attention`): q, k, v and the output are split over batch and heads.
- IHA (`sharded_iha_attention`): mixing contracts over the SOURCE heads, so every shard
  takes all H source heads of q, k, v (replicated in_specs: shard_map all-gathers the
  small `[B, N, H, d]` tensors), while alpha_* are split along their target axis, so a
  shard computes only its target heads' pseudo-heads; a full collapse then sums over
  every target head (a psum over `head_axis`), per_head stays local and head-sharded.
- Grouped-query (G < H key/value heads): split over `head_axis` with their query heads
  when the axis divides G, else kept whole, each shard taking the one its heads read.
- Sliced calls (a sequence shard, `iha_jax.parallel.context`): the key-side ids and
  positions are split over the batch axes like q's, a traced query offset replicated.
`iha_on_current_mesh` and its siblings are what the kind records name: the wrappers under
a mesh (with the logical-axis rules' axes, `iha_jax.parallel.sharding.kernel_axes`), the
kernels directly without one, so a layer makes one call whatever the mesh.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from iha_jax.core.options import AttentionOptions, OptionFields, with_overrides
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


def _prepare(q, k, mesh: MeshLike | None, batch_axes, head_axis, options: AttentionOptions):
  """(mesh, batch axes, head axis (`FROM_RULES`: the rules'), token arrays, whether the
  head axis splits the G key/value heads (`_kv_split`), and else `local_kv(x, axis)`: the
  one of x's key/value heads this shard's query heads read) of a sharded call."""
  mesh = _current(mesh)
  if batch_axes is FROM_RULES or head_axis is FROM_RULES:
    rules = sharding.kernel_axes(mesh) or dict(batch_axes=(), head_axis=None)
    batch_axes = rules["batch_axes"] if batch_axes is FROM_RULES else batch_axes
    head_axis = rules["head_axis"] if head_axis is FROM_RULES else head_axis
  batch = tuple(batch_axes)
  g = k.shape[2]
  check_divisible(mesh, q.shape[0], q.shape[2], batch, head_axis, kv_heads=g)
  shards = dict(zip(mesh.axis_names, mesh.axis_sizes))[head_axis] if head_axis else 1

  def local_kv(x, axis):  # G < shards: consecutive shards share a key/value head
    index = jax.lax.axis_index(head_axis) // (shards // g)
    return jax.lax.dynamic_slice_in_dim(x, index, 1, axis=axis)

  tokens = _Tokens(q, k, options, batch)
  return mesh, batch, head_axis, tokens, bool(_kv_split(g, shards)), local_kv


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
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """IHA's kernels via `jax.shard_map` over `mesh` (None: the current mesh): `kernel`
  (default `flash.attention.iha`; e.g. an on-chip window path's) on each shard, with the
  kernels of `platform` (`options.implementation` is not read).

  q `[B, N, H, d]`, k, v `[B, Nk, G, d]`, alpha_q `[H, H, P]`, alpha_k, alpha_v `[G, G,
  P]`, collapse `[H, H, P]` (full) or `[H, P]` (per_head); B divisible by the product of
  the `batch_axes` sizes, H by the `head_axis` size (`check_divisible`); `options` and
  `**overrides`: `AttentionOptions`, defaults filled here; `batch_axes`, `head_axis`: the
  mesh axes the batch and the heads split over (`()` / None: not split; `FROM_RULES`: the
  logical-axis rules'). -> `[B, N, H, d]`, batch-sharded (per_head: also head-sharded)."""
  options = with_overrides(options, overrides)
  prepared = _prepare(q, k, mesh, batch_axes, head_axis, options)
  mesh, batch, head_axis, tokens, split_kv, local_kv = prepared
  full = collapse.ndim == 3

  def local(q, k, v, alpha_q, alpha_k, alpha_v, collapse, *token_arrays):
    local_options = tokens.options(options, token_arrays)
    if not split_kv:  # all G target heads here: keep the one this shard's queries read
      alpha_k, alpha_v = (local_kv(a, 1) for a in (alpha_k, alpha_v))
    y = (kernel or attention.iha)(
      q, k, v, (alpha_q, alpha_k, alpha_v), collapse, local_options, platform=platform
    )
    if full and head_axis:  # every output head mixes every target head: sum the shares
      y = jax.lax.psum(y, head_axis)
    return y.astype(q.dtype)

  source = P(batch, None, None, None)
  alpha = P(None, head_axis, None)
  kv_alpha = alpha if split_kv else P(None, None, None)
  collapse_spec = alpha if full else P(head_axis, None)
  in_specs = (source, source, source, alpha, kv_alpha, kv_alpha, collapse_spec, *tokens.specs)
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
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """`kernel` (`flash.attention.mha`, or `splash.splash_mha_attention`) via
  `jax.shard_map`: heads are independent, so q `[B, N, H, d]`, k, v `[B, N, G, dv]` and
  the output `[B, N, H, dv]` stay split over batch and heads; the rest as
  `sharded_iha_attention`'s."""
  options = with_overrides(options, overrides)
  prepared = _prepare(q, k, mesh, batch_axes, head_axis, options)
  mesh, batch, head_axis, tokens, split_kv, local_kv = prepared

  def local(q, k, v, *token_arrays):
    if not split_kv:  # all G heads here: keep the one this shard's queries read
      k, v = (local_kv(x, 2) for x in (k, v))
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


def _window_outputs(q, k, v, alphas, collapse, options, *, platform: str) -> jax.Array:
  """IHA's on-chip window path of `platform` (same signature and semantics on both)."""
  path = {"tpu": tpu_window, "gpu": gpu_window}[platform]
  return path.window_iha(q, k, v, alphas, collapse, options)


# The registry's kernel entries: one call, whatever the mesh.
iha_on_current_mesh = functools.partial(
  _on_current_mesh, _unsharded(attention.iha), sharded_iha_attention
)
mha_on_current_mesh = functools.partial(_on_current_mesh, attention.mha, sharded_mha_attention)
_WINDOW = (
  _unsharded(_window_outputs),
  functools.partial(sharded_iha_attention, kernel=_window_outputs),
)
iha_window_on_current_mesh = functools.partial(_on_current_mesh, *_WINDOW, platform="tpu")
iha_gpu_window_on_current_mesh = functools.partial(_on_current_mesh, *_WINDOW, platform="gpu")
# jax's splash attention (TPU), under shard_map on a mesh like the kernels above.
splash_on_current_mesh = functools.partial(
  _on_current_mesh,
  splash.splash_mha_attention,
  functools.partial(sharded_mha_attention, kernel=splash.splash_mha_attention),
  platform="tpu",
)
