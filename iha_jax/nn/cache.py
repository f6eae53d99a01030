"""One attention layer's KV cache and its cached call: prefill and decoding through the layer.

`LayerCache` is a ring buffer over token slots (token `n` in slot `n % C`) plus the number
of tokens written. Global layers hold `C = max_len` slots (the ring never wraps); window
layers only the tokens their window can see (`ring_slots`). The layer's call with a cache
(`Attention.__call__(x, cache=...)`, `iha_jax.nn.call.run_layer`) takes the next `n >= 1`
tokens of every row (a prompt, a chunk of one, or one token), attends with them over what
the cache holds plus themselves, writes them, and returns the output and the new cache:
prefill and one-token decoding are the same call, the layer's entry point with its
queries at an offset into longer keys (`cached_heads`). Its output equals the full
forward's at those positions.

Layouts (head-major), G the layer's key/value heads (`num_kv_heads`):
- "source": the SOURCE-head k and v before mixing and RoPE, `[B, G, C, d]`, the size of
  a multi-head cache with G heads; each call runs the kind's entry point over them and
  the new tokens (IHA mixes and rotates the cached tokens again: less memory, more work
  per call).
- "pseudo" (IHA): the rotated pseudo-keys and the pseudo-values, `[B, G, C*P, d]` (P
  times larger; slot c holds virtual tokens `c*P .. c*P+P-1`): a call mixes and rotates
  only its new tokens. For MHA (P = 1) "pseudo" is a cache of rotated keys; for PHA the
  rotated virtual key/value rows, `[B, G', C*P, d]` (G' = `pseudo_kv_heads`: H/P at G =
  H, the source cache's size).
A kind decodes when its record says so (`AttentionKind.decodes`: it reads as pseudo-head
attention, `entry_arrays`, `pseudo_heads` and `collapse`; IHA and MHA built in).

Every row holds its own number of tokens (`length: [B]`): a ragged batch (prompts of
different lengths, padded on either side) prefills and decodes together, each row's
positions and window its own. A call's `valid: [B, n]` says which of its n tokens are
real; the real tokens of a row take its next positions in order (`length[b] + 0, 1, ..`),
the padding is never seen, writes nothing and outputs zeros. Without `valid` every token
is real (positions `length + arange(n)`, as the full forward's default).

A cache carries what it was made for (`CacheSpec`: the layer's kind, P, key/value heads,
head width, window, mode and capacity) and a layer refuses any other cache in one line.
Tokens past `max_len` would wrap a global layer's ring buffer: with a concrete length
(eager calls) that is a ValueError before anything runs; with a traced length (under
`jit`) the call's output is NaN from the first token past `max_len` on, never silently
wrong, and `jax.experimental.checkify.checkify(step, errors=checkify.user_checks |
checkify.float_checks)` turns it into an error naming the cache's `max_len`
(docs/your_model.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import checkify

from iha_jax.checks import is_int, is_traced, warn_deprecated
from iha_jax.core.attention import virtual_options
from iha_jax.kinds import project_qkv
from iha_jax.kinds.config import AttentionConfig
from iha_jax.nn.functional import Handed, rotated_pseudo_heads

CACHE_MODES = ("source", "pseudo")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """What a cache was made for (static): a cache serves only a layer whose own spec is
  equal (`spec_for`)."""

  kind: str
  num_pseudo: int  # P (1 for MHA)
  kv_heads: int  # G
  head_dim: int
  window: int | None  # in the kind's units (virtual tokens for IHA)
  mode: str  # "source" or "pseudo"
  capacity: int  # token slots C
  max_len: int  # tokens a row may hold in all (the capacity of a global layer)

  @property
  def unbounded(self) -> bool:
    """Whether the ring holds a window's whole reach: any number of tokens decodes."""
    return self.window is not None and self.capacity < self.max_len

  def differences(self, other: CacheSpec) -> list[str]:
    fields = ("kind", "num_pseudo", "kv_heads", "head_dim", "window", "mode", "capacity")
    return [
      f"{f} {getattr(self, f)!r} (this layer: {getattr(other, f)!r})"
      for f in fields
      if getattr(self, f) != getattr(other, f)
    ]


def spec_for(cfg: AttentionConfig, max_len: int, mode: str) -> CacheSpec:
  """The `CacheSpec` of a cache for a layer of `cfg` holding up to `max_len` tokens."""
  return CacheSpec(
    kind=cfg.kind,
    num_pseudo=cfg.record.num_pseudo(cfg),
    kv_heads=cfg.kv_heads,
    head_dim=cfg.head_dim,
    window=cfg.window,
    mode=mode,
    capacity=ring_slots(cfg, max_len),
    max_len=max_len,
  )


class LayerCache(struct.PyTreeNode):
  """One layer's KV cache.

  Attributes:
    k, v: the ring buffer, `[B, G, C, d]` ("source" IHA, or MHA) or `[B, G, C*P, d]`
      ("pseudo" IHA): C token slots, token n in slot `n % C`.
    length: `[B]` int32, the tokens each row holds = the position of its next token.
    spec: what the cache was made for (static; `CacheSpec`).
  """

  k: jax.Array
  v: jax.Array
  length: jax.Array
  spec: CacheSpec = struct.field(pytree_node=False)

  @property
  def mode(self) -> str:
    """ "source" or "pseudo" (the module docstring)."""
    return self.spec.mode

  @property
  def nbytes(self) -> int:
    """Bytes of the cached keys and values."""
    return self.k.nbytes + self.v.nbytes


def check_cache_mode(cache_mode: str) -> None:
  """Raises ValueError naming `cache_mode` unless it is one of `CACHE_MODES`."""
  if cache_mode not in CACHE_MODES:
    raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")


def check_decodes(cfg: AttentionConfig) -> None:
  """Raises ValueError unless a layer of `cfg` can run with a cache: a causal layer of a
  kind that decodes."""
  if not cfg.record.decodes:
    raise ValueError(
      f"{cfg.kind} attention has no KV cache (its kind does not read as pseudo-head "
      "attention: AttentionKind.decodes); IHA, MHA and PHA layers decode. Run the full forward."
    )
  if not cfg.causal:
    raise ValueError(
      "a KV cache needs a causal layer; this one has causal=False (bidirectional: every "
      "position sees later tokens). Run the full forward."
    )


def _stores_source(cfg: AttentionConfig, mode: str) -> bool:
  """Whether the cache holds source heads (IHA's "source" mode), rebuilt every call."""
  return mode == "source" and cfg.record.virtual_tokens


def _cached_heads(cfg: AttentionConfig, mode: str) -> int:
  """Key/value heads the cache holds: G, or the kind's `pseudo_kv_heads` for pseudo-heads
  (PHA regroups them)."""
  return cfg.kv_heads if mode == "source" else cfg.record.pseudo_kv_heads(cfg)


def _slots_per_token(cfg: AttentionConfig, mode: str) -> int:
  """Cache entries per token: 1 for source heads, P for pseudo-heads (1 for MHA)."""
  return 1 if _stores_source(cfg, mode) else cfg.record.num_pseudo(cfg)


def ring_slots(cfg: AttentionConfig, max_len: int) -> int:
  """Token slots C of a layer's ring buffer: a window of `w` virtual tokens lets query
  `n*P + p` see keys down to `n*P - w + 1`, of tokens `n - ceil((w-1)/P) .. n`
  (`ceil((w-1)/P) + 1` tokens; `w` for MHA); global layers, and longer windows, `max_len`."""
  if cfg.window is None:
    return max_len
  span = -(-(cfg.window - 1) // cfg.record.num_pseudo(cfg)) + 1
  return min(span, max_len)


def slot_tokens(position: jax.Array, capacity: int) -> jax.Array:
  """Token held by each of `capacity` slots once token `position` is written, `[C]` int32:
  slot j holds the latest token `t <= position` with `t % C == j`; negative = empty."""
  return position - jnp.mod(position - jnp.arange(capacity, dtype=jnp.int32), capacity)


def init_layer_cache(
  cfg: AttentionConfig, batch: int, max_len: int, mode: str = "source", dtype: Any = None
) -> LayerCache:
  """An empty cache for a layer of `cfg` (zeros; slots are masked until written).

  Args:
    cfg: the layer's configuration (a kind that decodes, causal).
    batch: B, rows decoded together.
    max_len: tokens each row may hold in all (prompt plus every token fed later); window
      layers keep only `ring_slots(cfg, max_len)` of them.
    mode: "source" or "pseudo" (module docstring).
    dtype: of the cached keys and values, floating (None: `cfg.dtype`, else float32).
  """
  check_decodes(cfg)
  check_cache_mode(mode)
  for name, value in (("batch", batch), ("max_len", max_len)):
    if not is_int(value, 1):
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
  dtype = dtype or cfg.dtype or jnp.float32
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"dtype={jnp.dtype(dtype).name}: a cache holds keys and values, a floating dtype "
      "(float32, bfloat16, float16); None: the layer's dtype"
    )
  spec = spec_for(cfg, max_len, mode)
  heads = _cached_heads(cfg, mode)
  shape = (batch, heads, spec.capacity * _slots_per_token(cfg, mode), cfg.head_dim)
  zeros = jnp.zeros(shape, dtype)
  return LayerCache(k=zeros, v=zeros, length=jnp.zeros((batch,), jnp.int32), spec=spec)


class NewTokens(NamedTuple):
  """A cached call's new tokens as attended and written (`cached_heads`): each row's real
  tokens first, in order, then its padding.

  Attributes:
    k, v: the keys and values the cache stores, `[B, n*S, G, d]` (S: 1, or P for a
      "pseudo" cache's pseudo-heads).
    counts: `[B]` int32, each row's real tokens (n without `valid`).
    order: `[B, n]`, the input column of each attended token (None: no padding, no
      reordering).
  """

  k: jax.Array
  v: jax.Array
  counts: jax.Array
  order: jax.Array | None


def _write(
  buf: jax.Array, new: jax.Array, start: jax.Array, counts: jax.Array, slots_per_token: int
) -> jax.Array:
  """Writes each row's tokens `start[b] .. start[b] + counts[b] - 1` into its ring buffer
  (token t in slot t % C), keeping its last C: `buf: [B, G, C*S, d]`, `new: [B, n*S, G, d]`
  (S: `slots_per_token`; a row's first `counts[b]` tokens are real), `start, counts: [B]`."""
  b, h, size, d = buf.shape
  capacity, n = size // slots_per_token, new.shape[1] // slots_per_token
  steps = jnp.arange(n, dtype=jnp.int32)
  # Padding, and tokens older than the last C (overwritten anyway: keeps slots unique), go
  # to slot C, out of bounds: dropped.
  kept = (steps < counts[:, None]) & (steps >= counts[:, None] - capacity)
  slots = jnp.where(kept, jnp.mod(start[:, None] + steps, capacity), capacity)  # [B, n]
  new = new.reshape(b, n, slots_per_token, h, d).astype(buf.dtype)
  new = jnp.transpose(new, (0, 3, 1, 2, 4))  # [B, G, n, slots_per_token, d]
  ring = buf.reshape(b, h, capacity, slots_per_token, d)
  ring = jax.vmap(lambda r, s, x: r.at[:, s].set(x, mode="drop"))(ring, slots, new)
  return ring.reshape(buf.shape)


def _plural(count: int, noun: str) -> str:
  return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def check_cache(
  cfg: AttentionConfig, cache: LayerCache, x: jax.Array, valid: jax.Array | None = None
) -> None:
  """Raises ValueError unless a layer of `cfg` can take its next tokens `x: [B, n, D]`
  (`valid: [B, n]` bool, the real ones) with `cache` (`check_decodes`): one line naming
  what differs between the cache and this layer, or the overflow of a concrete length (a
  traced one poisons the output instead: `write_cache`)."""
  check_decodes(cfg)
  if not isinstance(cache, LayerCache):
    raise TypeError(f"cache must be a LayerCache (init_layer_cache), got {type(cache).__name__}")
  check_cache_mode(cache.mode)
  differ = cache.spec.differences(spec_for(cfg, cache.spec.max_len, cache.mode))
  if differ:
    raise ValueError(
      f"this cache was made for another layer: its {'; '.join(differ)}. Make one with "
      "this layer's init_cache (every layer keeps its own cache)."
    )
  batch, tokens = x.shape[:2]
  heads = _cached_heads(cfg, cache.mode)
  want = (batch, heads, None, cfg.head_dim)
  got = tuple(cache.k.shape)
  slots_per_token = _slots_per_token(cfg, cache.mode)
  if len(got) != 4 or got[:2] != want[:2] or got[3] != want[3] or got[2] % slots_per_token:
    raise ValueError(
      f"cache.k has shape {got}; this layer's {cache.mode!r} cache is [B, G, C * "
      f"{slots_per_token}, d] = [{batch}, {heads}, C * {slots_per_token}, {cfg.head_dim}] "
      "(init_layer_cache with this layer's config and batch)"
    )
  if jnp.shape(cache.length) != (batch,):
    raise ValueError(
      f"cache.length has shape {jnp.shape(cache.length)}, not [B] = ({batch},): a cache holds "
      "each row's length (init_layer_cache)"
    )
  if cache.spec.unbounded or is_traced(cache.length) or is_traced(valid):
    return
  counts = [tokens] * batch if valid is None else [int(c) for c in jnp.sum(valid, axis=1)]
  for row, (length, count) in enumerate(zip(cache.length.tolist(), counts)):
    if length + count > cache.spec.max_len:
      raise ValueError(
        f"{_plural(count, 'more token')} after the {length} that row {row} of this cache "
        f"holds exceed its max_len={cache.spec.max_len}: make the cache with "
        "init_cache(batch, max_len) large enough for the prompt and every token decoded "
        "after it"
      )


def cached_heads(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  cache: LayerCache,
  valid: jax.Array | None = None,
) -> tuple[Handed, NewTokens]:
  """What a cached call hands the kind, and the tokens it writes. Per row: the keys are
  the C tokens its cache held before this call, in position order (the ring rotated;
  slots before token 0 are padding), then its n new ones, real tokens first (`NewTokens`);
  the queries sit at offset C (as a sequence shard runs), so every row's keys lie at the
  offsets of their positions whatever its length. A "pseudo" cache's rotated pseudo-heads
  go to MHA's entry point over the virtual rows, before the kind's collapse.

  Args:
    params: `{name: array}` as laid out by `iha_jax.nn.config.param_specs(cfg)`, in the
      computation dtype.
    x: the layer's input for each row's next n tokens, `[B, n, D]`, in the computation
      dtype.
    cfg: the layer configuration (a kind that decodes, causal).
    cache: the layer's cache holding the tokens before them (`check_cache`).
    valid: `[B, n]` bool, the real tokens (None: all); the rest is padding.
  """
  b, n = x.shape[:2]
  capacity, num_pseudo = cache.spec.capacity, cache.spec.num_pseudo
  slots_per_token = _slots_per_token(cfg, cache.mode)
  start = jnp.asarray(cache.length, jnp.int32)  # [B]
  if valid is None:
    order, real = None, jnp.ones((b, n), bool)
  else:
    order = jnp.argsort(~valid, axis=1, stable=True)  # real tokens first, in order
    x = jnp.take_along_axis(x, order[:, :, None], axis=1)
    real = jnp.take_along_axis(valid, order, axis=1)
  q, k, v = project_qkv(params, x)  # [B, n, H, d], [B, n, G, d]
  positions = start[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, n]
  # The ring in position order: row r holds token start - C + r (padding before token 0).
  key_tokens = start[:, None] - capacity + jnp.arange(capacity + n, dtype=jnp.int32)
  key_real = jnp.concatenate([key_tokens[:, :capacity] >= 0, real], axis=1)  # [B, C + n]
  shift = -jnp.mod(start, capacity) * slots_per_token
  roll = jax.vmap(lambda c, s: jnp.roll(c, s, axis=1))
  old_k, old_v = (
    jnp.swapaxes(roll(c, shift), 1, 2).astype(x.dtype) for c in (cache.k, cache.v)
  )  # [B, C*S, G, d]
  query_segments = None if valid is None else real.astype(jnp.int32)
  options = cfg.options(positions=positions, segment_ids=query_segments).replace(
    query_offset=capacity, kv_positions=key_tokens, kv_segment_ids=key_real.astype(jnp.int32)
  )
  if cache.mode == "pseudo":
    q, k = (rotated_pseudo_heads(params, cfg, w, t, positions) for w, t in (("q", q), ("k", k)))
    v = cfg.record.pseudo_heads(params, cfg, "v", v)  # [B, n*P, G, d]; values: no RoPE
    # MHA's entry point over the virtual rows: the same call in virtual units, rotated already.
    options = virtual_options(options.replace(rope_theta=None), num_pseudo)
  keys, values = (jnp.concatenate([old, new], axis=1) for old, new in ((old_k, k), (old_v, v)))
  handed = Handed(options, (q, keys, values), cache.mode == "pseudo", new_tokens=n)
  return handed, NewTokens(k, v, jnp.sum(real, axis=1, dtype=jnp.int32), order)


def write_cache(y: jax.Array, cache: LayerCache, new: NewTokens) -> tuple[jax.Array, LayerCache]:
  """The cached call's output `y: [B, n, out]` in the input's columns (padding zero; NaN
  past a bounded cache's `max_len`) and the cache with each row's `new` real tokens
  (`cached_heads`) in their slots and its `length` advanced by their count."""
  n = y.shape[1]
  start = jnp.asarray(cache.length, jnp.int32)
  steps = jnp.arange(n, dtype=jnp.int32)
  if not cache.spec.unbounded:
    # Tokens past max_len: NaN, not a wrapped ring's output, made by an operation (the
    # square root of -1) so that checkify's float checks find it; its user checks name why.
    overflow = (steps < new.counts[:, None]) & (start[:, None] + steps >= cache.spec.max_len)
    checkify.debug_check(
      ~jnp.any(overflow),
      f"a cached call wrote past its cache's max_len={cache.spec.max_len} (a row's length "
      "plus its new tokens): make the cache with init_cache(batch, max_len) large enough",
    )
    y = y * jnp.sqrt(1 - 2 * overflow.astype(y.dtype))[:, :, None]
  if new.order is not None:  # back to the input's columns
    y = jnp.take_along_axis(y, jnp.argsort(new.order, axis=1)[:, :, None], axis=1)
  slots_per_token = cache.k.shape[2] // cache.spec.capacity  # 1, or P for pseudo-heads
  cache = cache.replace(
    k=_write(cache.k, new.k, start, new.counts, slots_per_token),
    v=_write(cache.v, new.v, start, new.counts, slots_per_token),
    length=start + new.counts,
  )
  return y, cache


def __getattr__(name: str) -> object:
  if name == "window_tokens":  # renamed: `window_tokens` is a window in tokens (the layers')
    warn_deprecated("iha_jax.nn.cache.window_tokens", "ring_slots (the ring's token slots)")
    return ring_slots
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
