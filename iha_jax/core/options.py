"""Option types and tile arithmetic shared by every attention kind and implementation
(a leaf module).

`AttentionOptions` is the one object for the keywords every kind shares: the layer
builds it, the kind's entry point checks it once (`iha_jax.kinds.registry.attend`), and
the implementations, the Pallas kernels and their shard_map wrappers receive it as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict, Unpack

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile edges for the blockwise implementations (None = the implementation's default).

  In virtual tokens for IHA (tokens for the other kinds). The Pallas flash kernels tile
  the virtual rows: TPU tiles are multiples of 16 rows, GPU tiles powers of two >= 16.
  IHA's on-chip window path reads `block_q` as the virtual rows per target head of a grid
  step (rounded to whole tokens) and `block_k` as the query rows of a score tile. The
  query-chunked XLA paths (talking-heads, 2-simplicial) read `block_q` only.
  """

  block_q: int | None = None
  block_k: int | None = None


def round_up(x: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= `x` (tile padding)."""
  return -(-x // multiple) * multiple


def pad_to(x: jax.Array, total: int, axis: int, **pad: Any) -> jax.Array:
  """`x` padded (`jnp.pad`'s `pad` keywords; default zeros) on `axis` to `total`; a no-op
  (no op at all, so no pad in the VJP) if full."""
  if x.shape[axis] == total:
    return x
  widths = [(0, total - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)]
  return jnp.pad(x, widths, **pad)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionOptions:
  """The options every attention kind shares (a pytree: the arrays are its leaves).

  Attributes:
    window: sliding window in the kind's sequence units: VIRTUAL tokens for IHA (over
      `T = N * P`), tokens for every other kind (`t - s < window`; `|t - s| < window`
      when not causal); None = global.
    causal: keys at or before the query only; False: bidirectional (encoders).
    rope_theta: RoPE base; None disables RoPE (2-simplicial attention never rotates).
    segment_ids: `[B, N]` int32 packed-sequence ids, 0 = padding (zero output); None:
      one unpadded sequence per row. Compared by equality: tokens with equal ids attend
      to each other wherever they are in the row (ids need not be contiguous).
    positions: `[B, N]` int32 token positions; None: `arange(N)` per row.
    block_sizes: tile sizes of the blockwise implementations (None: their defaults).
    implementation: one of the kind's implementations ("reference", "xla",
      "pallas_tpu", "pallas_gpu", "pallas_gpu_mha", "cudnn" for IHA; each kind's record
      lists its own, `iha_jax.kinds.registry.implementations`) or "auto"
      (`iha_jax.kinds.registry.resolve`).
    query_offset: queries that are a slice of a longer sequence than the keys (a sequence
      shard, `iha_jax.parallel.context`): the token index of the first query minus that
      of the first key, an int or an int32 scalar (may be traced); 0 with keys and
      queries of one sequence. Keys and values may then hold `Nk != N` tokens.
    kv_segment_ids: `[B, Nk]` segment ids of the keys (None: `segment_ids`, Nk = N).
    kv_positions: `[B, Nk]` token positions of the keys (None: `positions`, Nk = N).
    dropout_rate: attention dropout: each attention weight is dropped with this
      probability and the kept ones scaled by `1 / (1 - rate)`; 0: none (the layers set it
      only while training). Only some implementations apply it (a kind's
      `dropout_implementations`: "xla"); the others refuse a rate > 0.
    dropout_rng: the PRNG key of the dropout masks (required when `dropout_rate` > 0).
  """

  window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
  rope_theta: float | None = dataclasses.field(default=10000.0, metadata=dict(static=True))
  segment_ids: Any = None
  positions: Any = None
  block_sizes: BlockSizes | None = dataclasses.field(default=None, metadata=dict(static=True))
  implementation: str = dataclasses.field(default="auto", metadata=dict(static=True))
  query_offset: Any = 0
  kv_segment_ids: Any = None
  kv_positions: Any = None
  dropout_rate: float = dataclasses.field(default=0.0, metadata=dict(static=True))
  dropout_rng: Any = None

  @property
  def key_segment_ids(self) -> Any:
    """`kv_segment_ids`, else `segment_ids` (keys and queries of one sequence)."""
    return self.segment_ids if self.kv_segment_ids is None else self.kv_segment_ids

  @property
  def key_positions(self) -> Any:
    """`kv_positions`, else `positions`."""
    return self.positions if self.kv_positions is None else self.kv_positions

  @property
  def sliced(self) -> bool:
    """True when the queries are a slice of the keys' sequence (a sequence shard)."""
    return not (
      isinstance(self.query_offset, int)
      and self.query_offset == 0
      and self.kv_segment_ids is None
      and self.kv_positions is None
    )

  def replace(self, **changes: Unpack[OptionFields]) -> AttentionOptions:
    """A copy with `changes` (keyword names checked)."""
    return with_overrides(self, changes)


class OptionFields(TypedDict, total=False):
  """`AttentionOptions`' fields as keywords, typed: what the entry points
  (`iha_attention(..., window=8, implementation="xla")`, ...), `registry.attend` and
  `AttentionOptions.replace` take beside an `AttentionOptions` (the same names and
  meanings; tests/kinds/test_validation.py holds the two to one set of names)."""

  window: int | None
  causal: bool
  rope_theta: float | None
  segment_ids: jax.Array | None
  positions: jax.Array | None
  block_sizes: BlockSizes | None
  implementation: str
  query_offset: int | jax.Array
  kv_segment_ids: jax.Array | None
  kv_positions: jax.Array | None
  dropout_rate: float
  dropout_rng: jax.Array | None


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(AttentionOptions))


def with_overrides(options: AttentionOptions | None, overrides: OptionFields) -> AttentionOptions:
  """`options` (default `AttentionOptions()`) with the keyword `overrides` applied; an
  unknown keyword is refused naming the known ones (at run time too: `**overrides` may
  come from an untyped dict)."""
  unknown = sorted(set(overrides) - set(OPTION_NAMES))
  if unknown:
    raise TypeError(f"unknown attention option(s) {unknown}; the options are {OPTION_NAMES}")
  if options is not None and not isinstance(options, AttentionOptions):
    raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
  return dataclasses.replace(options or AttentionOptions(), **overrides)
