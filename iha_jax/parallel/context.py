"""Context (sequence) parallelism for every attention kind: the `context` mesh axis.

Activations `[B, N, ...]` are split over the `context` axis along N (the logical rules map
`activation_length` to it); every op of the model is token-wise except attention, which
`attend` runs inside `jax.shard_map` over `context`, the batch axes and every axis of size
one; only a head axis that splits (`tensor` > 1) stays automatic, for the kernels' own
head `shard_map` to take. (A shard_map over `context` alone with the kernels' batch
`shard_map` nested inside crashes XLA:TPU's SPMD partitioner: "IsManualSubgroup" check.)
Each device keeps its queries and fetches only the SOURCE keys and values it needs
(before any head mixing and RoPE), so IHA moves exactly what MHA moves and no pseudo-head
tensor crosses devices:

- global layers: an all-gather of the key-side arrays (`[B, N, ...]` received per
  device, the whole sequence's source k and v);
- window layers: a halo, the `ceil((w - 1) / P)` tokens before each shard (and after it,
  bidirectional), from the neighbouring shard(s) by `ppermute` (several hops when the
  reach exceeds a shard); keys before the sequence start are padding (segment 0).

Every device then calls the kind's own implementation on its queries against those keys
(`AttentionOptions.query_offset`, `kv_segment_ids`, `kv_positions`; the implementations
`iha_jax.kinds.registry.SLICED`), so positions and masks stay global: the result equals the
unsharded computation. A window layer's offset is static, a global layer's traced.

Causal load balancing (`layout("balanced")`): with a causal mask the last shard of a
contiguous split does S times the work of the first. The balanced layout gives shard s
the chunks s and 2S-1-s of 2S equal chunks (the data are permuted on the host:
`balance_tokens`), so every shard does the same work; window layers then fetch each
chunk's halo from an all-gather of every chunk's edge tokens (2 * S * 2 * halo tokens
per device) instead of a neighbour exchange.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from iha_jax.parallel.axes import ACTIVATION_BATCH, ACTIVATION_LENGTH
from iha_jax.parallel.rules import free_mesh_axes

LAYOUTS = ("contiguous", "balanced")
QUERY, KEY, OTHER = "q", "kv", "-"  # roles of an implementation's array arguments

_LAYOUT = contextvars.ContextVar[str]("iha_context_layout", default=LAYOUTS[0])


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
  """Traces attention under `name` ("contiguous" or "balanced": the data's token order,
  see `balance_tokens`) inside the block."""
  if name not in LAYOUTS:
    raise ValueError(f"context layout must be one of {LAYOUTS}, got {name!r}")
  token = _LAYOUT.set(name)
  try:
    yield
  finally:
    _LAYOUT.reset(token)


def chunks_per_shard() -> int:
  """2 under the balanced layout, else 1."""
  return 2 if _LAYOUT.get() == "balanced" else 1


def chunk_order(shards: int, chunks: int) -> np.ndarray:
  """`[shards * chunks]`: the global chunk held at each local slot, shard-major (shard s
  holds `order[s*K : (s+1)*K]`): identity, or `s, 2S-1-s` balanced."""
  if chunks == 1:
    return np.arange(shards)
  return np.stack([np.arange(shards), 2 * shards - 1 - np.arange(shards)], 1).reshape(-1)


def balance_tokens(x: np.ndarray, shards: int, axis: int = 1) -> np.ndarray:
  """A `[B, N, ...]` batch array in the balanced layout (host side): the N tokens as 2S
  chunks, reordered so that shard s's contiguous share holds chunks s and 2S-1-s."""
  n = x.shape[axis]
  if n % (2 * shards):
    raise ValueError(f"sequence length {n} must divide into 2 x context = {2 * shards} chunks")
  parts = np.split(x, 2 * shards, axis=axis)
  return np.concatenate([parts[c] for c in chunk_order(shards, 2)], axis=axis)


def context_axis(mesh: Any | None = None) -> str | None:
  """The mesh axis the sequence splits over: the one the active logical-axis rules (the
  project's, `context`, when none are active) map `activation_length` to, when the mesh
  (default: the current one) has it and is not already inside a `shard_map` over it."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    return None
  axes = free_mesh_axes(mesh, ACTIVATION_LENGTH)
  if len(axes) > 1:
    raise ValueError(
      f"the logical-axis rules split the sequence ({ACTIVATION_LENGTH}) over {axes}; "
      "context parallelism takes one mesh axis"
    )
  return axes[0] if axes else None


def context_shards(mesh: Any | None = None) -> int:
  """Size of the current mesh's sequence axis (`context_axis`), else 1."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  axis = context_axis(mesh)
  return 1 if axis is None else dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]


def applies(num_tokens: int) -> bool:
  """Whether a call over `num_tokens` tokens runs context-parallel on the current mesh:
  a context axis > 1 that the sequence divides into (chunks of) equal shards."""
  shards = context_shards()
  return shards > 1 and num_tokens % (shards * chunks_per_shard()) == 0


def reach_tokens(window: int | None, num_pseudo: int) -> int | None:
  """Tokens before (and, bidirectional, after) a query that a window of `window` units
  (virtual tokens when `num_pseudo` = P > 1) can reach: `ceil((w - 1) / P)`; None: all."""
  return None if window is None else -(-(window - 1) // num_pseudo)


def _shift(x: jax.Array, hops: int, shards: int, axis: str) -> jax.Array:
  """Shard s receives shard s - hops's `x` (zeros where that shard does not exist)."""
  pairs = [(i, i + hops) for i in range(shards) if 0 <= i + hops < shards]
  return jax.lax.ppermute(x, axis, pairs) if pairs else jnp.zeros_like(x)


def _halo(x: jax.Array, reach: int, shards: int, after: bool, axis: str) -> jax.Array:
  """The `reach` tokens before (after) this shard's `x: [B, n, ...]` along axis 1, from
  `ceil(reach / n)` neighbouring shards over mesh axis `axis` (zeros past the ends)."""
  hops = -(-reach // x.shape[1])
  if after:
    pieces = [_shift(x, -hop, shards, axis) for hop in range(1, hops + 1)]
    return jnp.concatenate(pieces, axis=1)[:, :reach]
  pieces = [_shift(x, hop, shards, axis) for hop in range(hops, 0, -1)]
  return jnp.concatenate(pieces, axis=1)[:, -reach:]


def _natural(chunked: jax.Array, shards: int, chunks: int) -> jax.Array:
  """`[B, S*K, ...]` per-chunk items in shard-major slot order -> natural chunk order."""
  return chunked[:, np.argsort(chunk_order(shards, chunks))]


def _gather(x: jax.Array, shards: int, chunks: int, axis: str) -> jax.Array:
  """The whole sequence `[B, N, ...]` in natural token order, from every shard's `x`."""
  full = jax.lax.all_gather(x, axis, axis=1, tiled=True)  # shard-major slots
  if chunks == 1:
    return full
  b, n = full.shape[:2]
  per_chunk = full.reshape(b, shards * chunks, n // (shards * chunks), *full.shape[2:])
  return _natural(per_chunk, shards, chunks).reshape(full.shape)


def _chunk_edges(
  x: jax.Array, reach: int, shards: int, chunks: int, axis: str
) -> tuple[jax.Array, ...]:
  """Every chunk's first and last `reach` tokens, natural chunk order: two
  `[B, S*K, reach, ...]` (the balanced layout's halo source)."""
  c = x.shape[1] // chunks
  firsts = jnp.stack([x[:, k * c : k * c + reach] for k in range(chunks)], axis=1)
  lasts = jnp.stack([x[:, (k + 1) * c - reach : (k + 1) * c] for k in range(chunks)], axis=1)
  gathered = (jax.lax.all_gather(e, axis, axis=1, tiled=True) for e in (firsts, lasts))
  return tuple(_natural(g, shards, chunks) for g in gathered)


def _key_views(keys, segments, reach, causal, shards, chunks, axis):
  """For each local chunk: (key-side arrays `[B, Nk, ...]`, their segment ids `[B, Nk]`,
  the chunk's first query index minus the first key's). `keys` end with the positions."""
  c = segments.shape[1] // chunks
  slot_chunk = jnp.asarray(chunk_order(shards, chunks)).reshape(shards, chunks)
  here = jax.lax.axis_index(axis)
  total_chunks = shards * chunks
  if reach is None:  # global: the whole sequence, natural order
    every = [_gather(x, shards, chunks, axis) for x in (*keys, segments)]
    return [(every[:-1], every[-1], slot_chunk[here, k] * c) for k in range(chunks)]
  views = []
  if chunks == 1:  # a neighbour exchange
    start = here * c
    for_side = lambda after: [_halo(x, reach, shards, after, axis) for x in (*keys, segments)]
    parts, valid = [for_side(False)], [jnp.arange(reach) >= reach - start]
    parts.append([*keys, segments])
    valid.append(jnp.ones((c,), bool))
    if not causal:
      parts.append(for_side(True))
      valid.append(jnp.arange(reach) < total_chunks * c - start - c)
    joined = [jnp.concatenate(p, axis=1) for p in zip(*parts)]
    segs = jnp.where(jnp.concatenate(valid), joined[-1], 0)
    return [(joined[:-1], segs, reach)]
  edges = [_chunk_edges(x, reach, shards, chunks, axis) for x in (*keys, segments)]
  for k in range(chunks):
    chunk = slot_chunk[here, k]
    own = [x[:, k * c : (k + 1) * c] for x in (*keys, segments)]
    before = [jnp.take(last, jnp.maximum(chunk - 1, 0), axis=1) for _, last in edges]
    parts, valid = [before, own], [jnp.full((reach,), chunk > 0), jnp.ones((c,), bool)]
    if not causal:
      nxt = jnp.minimum(chunk + 1, total_chunks - 1)
      parts.append([jnp.take(first, nxt, axis=1) for first, _ in edges])
      valid.append(jnp.full((reach,), chunk < total_chunks - 1))
    joined = [jnp.concatenate(p, axis=1) for p in zip(*parts)]
    segs = jnp.where(jnp.concatenate(valid), joined[-1], 0)
    views.append((joined[:-1], segs, reach))
  return views


def _manual_axes(mesh: Any, batch_size: int, axis: str) -> tuple[tuple[str, ...], set[str]]:
  """(the batch axes, every axis `attend`'s shard_map takes): the sequence axis `axis`,
  the batch axes of the active logical rules (when they divide `batch_size`) and the axes
  of size one, minus those already manual."""
  free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
  batch = free_mesh_axes(mesh, ACTIVATION_BATCH)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  if batch_size % int(np.prod([sizes[a] for a in batch])):
    batch = ()  # e.g. one prompt on a data-parallel mesh: the batch stays automatic
  unit = {a for a, size in zip(mesh.axis_names, mesh.axis_sizes) if size == 1}
  return batch, ({axis, *batch} | unit) & free


def attend(
  fn: Callable[..., jax.Array], roles: Sequence[str], *args: Any, num_pseudo: int = 1
) -> jax.Array:
  """`fn(*arrays, options)` (an implementation of a kind, options checked) run
  context-parallel on the current mesh: the result equals `fn`'s on the whole sequence.

  Args:
    fn: the kind's implementation; takes the arrays then an `AttentionOptions`.
    roles: one per array: "q" (query side `[B, N, ...]`, stays local), "kv" (key side
      `[B, N, ...]`, gathered or exchanged), "-" (anything else, e.g. mixing weights:
      passed whole).
    *args: the arrays, then the `AttentionOptions` (positions defaulted).
    num_pseudo: virtual tokens per token (IHA's P): the window's unit.

  Returns:
    `fn`'s output `[B, N, ...]`, split over `context` like the queries.
  """
  *arrays, options = args
  if len(arrays) != len(roles) or QUERY not in roles:
    raise ValueError(f"roles {tuple(roles)} must name every one of {len(arrays)} arrays")
  mesh = jax.sharding.get_abstract_mesh()
  axis = context_axis(mesh)
  shards, chunks = context_shards(mesh), chunks_per_shard()
  query = arrays[roles.index(QUERY)]
  reach = reach_tokens(options.window, num_pseudo)
  if reach is not None and reach >= query.shape[1] // (shards * chunks):
    # A window reaching past the neighbouring chunk: gather everything (the window
    # still masks), which is what such a window costs anyway.
    reach = None if chunks > 1 or reach >= query.shape[1] else reach
  segment_ids = options.segment_ids
  if segment_ids is None:  # halo keys past the sequence ends need segment 0
    segment_ids = jnp.ones(query.shape[:2], jnp.int32)
  batch_axes, manual = _manual_axes(mesh, query.shape[0], axis)
  sequence = PartitionSpec(batch_axes or None, axis)
  specs = tuple(sequence if r in (QUERY, KEY) else PartitionSpec() for r in roles)

  def body(segments, positions, *local):
    keys = [x for x, r in zip(local, roles) if r == KEY] + [positions]
    views = _key_views(keys, segments, reach, options.causal, shards, chunks, axis)
    c = segments.shape[1] // chunks
    outs = []
    for k, (key_side, key_segments, offset) in enumerate(views):
      own = slice(k * c, (k + 1) * c)
      *kv, key_positions = key_side
      kv_iter = iter(kv)
      call = [
        x[:, own] if r == QUERY else next(kv_iter) if r == KEY else x for x, r in zip(local, roles)
      ]
      chunk_options = options.replace(
        segment_ids=segments[:, own],
        positions=positions[:, own],
        kv_segment_ids=key_segments,
        kv_positions=key_positions,
        query_offset=offset,
      )
      outs.append(fn(*call, chunk_options))
    return outs[0] if chunks == 1 else jnp.concatenate(outs, axis=1)

  mapped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(sequence, sequence, *specs),
    out_specs=sequence,
    axis_names=manual,
    check_vma=False,
  )
  return mapped(segment_ids, options.positions, *arrays)


def received_tokens(num_tokens: int, window: int | None, num_pseudo: int, shards: int) -> int:
  """Key-side tokens one device receives per layer (contiguous layout): `N - N/S` for a
  global layer, the halo `ceil((w - 1) / P)` (twice, bidirectional) for a window layer."""
  reach = reach_tokens(window, num_pseudo)
  local = num_tokens // shards
  if reach is None or reach >= num_tokens:
    return num_tokens - local
  return min(reach, num_tokens - local)
