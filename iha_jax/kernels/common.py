"""Tile math of the Triton GPU kernels (the TPU path, `iha_jax.kernels.tpu_attention`, mixes
pseudo-heads in HBM and needs none of it).

Everything here works on values already loaded from refs (2-D tiles), using only ops
both Pallas backends lower: 2-D dots, elementwise math, last-axis reductions and scalar
reads. The backends differ in how tiles reach the chip (TPU: grid axes + BlockSpec DMAs
+ VMEM scratch; GPU: loops + pointer loads) and in how a tile's virtual rows are ordered
(TPU: P pieces of `block` tokens stacked pseudo-major in scratch; GPU: token-major rows
gathered from the source heads, see `iha_jax.kernels.gpu`). Both attend with ONE
`[Rq, W] x [W, Rk]` matmul per tile pair, masked by `iha_jax.core.masking.visible` on the
true virtual index `t = n * P + p`, over the tiles of the mask's band (`kv_range`,
`q_range`), so the numerics live in one place.

Source layouts (built by `iha_jax.kernels.fused` outside the kernels):
- q: `[B, H, Np, W]`, k: `[B, G, Np, W]`, `W = 2 * half`: each RoPE half padded to
  `half` lanes (rotate-half pairs lane e with lane e + half; Triton needs power-of-two
  widths), tokens padded to `Np` (segment 0 = padding). q and k arrive rotated by
  `R(pos * P)`; the kernels apply the rest of virtual RoPE, `R(p)`, from `[P, half]`
  cos/sin tables.
- v: `[B, G, Np, Wv]`, `Wv = 2 * value_half`, split and padded the same way (MHA's v may
  be wider than q/k, e.g. `dv = 2d` for differential attention).
- mixing: `alpha_q` flattened to `[H_target * H_source * P]` float32, so a coefficient
  is one scalar read at `(h * H + m) * P + p`; `alpha_k`, `alpha_v` likewise over the G
  key/value heads, `[G_target * G_source * P]`.
- pseudo outputs, their cotangent, lse and delta: per backend (`OUTPUT_SPEC`).

Sliced calls (a sequence shard, `iha_jax.parallel.context`): the queries are `N` tokens
of a longer sequence whose keys arrive as `Nk` tokens (`[B, G, Nkp, W]`, their own segment
ids; keys outside the sequence are padding, segment 0). Query token n then has virtual
index `(offset + n) * P + p` on the keys' axis, where `offset` (the first query's token
index minus the first key's) is an int32 scalar operand, so one compiled kernel serves
every shard; the band arithmetic (`kv_range`, `q_range`) shifts by it, and the TPU
GPU's band loops run as far as each offset needs.

Grouped-query attention: G key/value heads, G dividing H; query target h attends with the
pseudo-keys and pseudo-values of key/value target `h // r` (`r = group`, `kv_target`).
Keys and values stay G heads in HBM: the kernels read key/value head `h // r` (mixing:
mix the G source heads with `alpha_k[:, h // r]`). Their gradients sum over the r query
heads of a group inside one program (GPU) or one resident output block (TPU), so no two
programs write the same rows; the per-tile partial `dalpha_k, dalpha_v` are kept per
QUERY target (`[H_target * G_source * P]`, slot h) and summed over each group outside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from iha_jax.core.masking import MASK_VALUE

Parts = tuple[jax.Array, ...]  # one tile split along lanes: (x1, x2) for q/k, (x,) for v


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


class Side(NamedTuple):
  """What one operand's pseudo tile mixes: its `target` head (the row of its flat alpha;
  without mixing, the head it reads), how many `sources` alpha contracts over (H for q, G
  for k and v), and the `slot` of its per-tile partial dalpha (the query target)."""

  target: Any
  sources: int
  slot: Any


@dataclasses.dataclass(frozen=True)
class Config:
  """Static kernel configuration (hashable: it is a custom_vjp nondiff argument).

  Attributes:
    num_heads: source query heads H (all of them feed every target head).
    num_kv_heads: source key/value heads G (mixing: all of them feed every key/value
      target; MHA: the key/value heads of the layout).
    num_targets: target (query) heads computed here (H, or the local share under head
      sharding); alpha_q arrives as `[num_targets, H, P]` flattened.
    kv_targets: key/value target heads computed here (G, or the local share); alpha_k,
      alpha_v arrive as `[kv_targets, G, P]` flattened. Query target h reads key/value
      target `h // group`.
    num_pseudo: P (1 for MHA).
    mixing: False for MHA: head h reads source head h, no alpha, no dalpha.
    head_dim: the caller's d of q and k (sets the softmax scale).
    half: lanes per RoPE half of q and k inside the kernels (>= ceil(d / 2)).
    value_half: lanes per half of v, the output and its cotangent (>= ceil(dv / 2)).
    block_q, block_k: tile edges in TOKENS (virtual rows = block * P).
    seq_len: padded token count Np, a multiple of both blocks.
    window: sliding window in virtual tokens, or None.
    rope: whether the kernels rotate pseudo-heads by their pseudo index p (RoPE at virtual
      position `pos * P + p` is `R(p) R(pos * P)`: the caller rotates the source heads by
      `R(pos * P)`, the kernels apply `R(p)` from a `[P, half]` table; false for P = 1).
    causal: virtual query t sees keys s <= t (and `t - s < window`); False:
      bidirectional, every key of its segment (and `|t - s| < window`).
    sliced: the queries are a slice of the keys' sequence: the kernels take the query
      offset (tokens) as an int32 scalar operand and the keys' own segment ids, and key
      tiles span `kv_seq_len` tokens. False: keys are the queries' tokens (no offset).
    kv_seq_len: padded key tokens of a sliced call, a multiple of block_k (else seq_len).
    static_offset: a sliced call's query offset when it is a Python int (the TPU band
      axes are then exactly as wide as it needs); None when traced (as wide as any offset
      needs). 0 for unsliced calls.
  """

  num_heads: int
  num_kv_heads: int
  num_targets: int
  kv_targets: int
  num_pseudo: int
  mixing: bool
  head_dim: int
  half: int
  value_half: int
  block_q: int
  block_k: int
  seq_len: int
  window: int | None
  rope: bool
  causal: bool
  launch: tuple | None = None  # GPU: (forward, dQ, dK/dV) `gpu_tiles.Launch`; TPU: None
  sliced: bool = False
  kv_seq_len: int = 0
  static_offset: int | None = 0

  @property
  def flat_alpha(self) -> int:
    """Entries of the flat alpha_q (and of its per-tile partial gradients)."""
    return self.num_targets * self.num_heads * self.num_pseudo

  @property
  def flat_alpha_kv(self) -> int:
    """Entries of the flat alpha_k, alpha_v."""
    return self.kv_targets * self.num_kv_heads * self.num_pseudo

  @property
  def dalpha_kv_slots(self) -> int:
    """Entries of a per-tile partial dalpha_k or dalpha_v: one slot per QUERY target, so
    the r query heads of a group never write the same entry."""
    return self.num_targets * self.num_kv_heads * self.num_pseudo

  @property
  def group(self) -> int:
    """r: query target heads per key/value target head (1 without grouped-query)."""
    return self.num_targets // self.kv_targets

  def kv_target(self, h):
    """The key/value target head of query target h (h may be traced; h >= 0)."""
    return h if self.group == 1 else lax.div(h, jnp.int32(self.group))

  def query_side(self, h) -> Side:
    """q's mixing for query target h: row h of alpha_q over the H source heads."""
    return Side(h, self.num_heads, h)

  def key_side(self, h) -> Side:
    """k's and v's mixing for query target h: row `h // group` of alpha_k / alpha_v over
    the G source heads; partial dalpha in slot h."""
    return Side(self.kv_target(h), self.num_kv_heads, h)

  @property
  def width(self) -> int:
    """Lanes of q and k tiles."""
    return 2 * self.half

  @property
  def value_width(self) -> int:
    """Lanes of v, output and output-cotangent tiles."""
    return 2 * self.value_half

  @property
  def scale(self) -> float:
    return self.head_dim**-0.5

  @property
  def num_q_blocks(self) -> int:
    return self.seq_len // self.block_q

  @property
  def key_len(self) -> int:
    """Padded key tokens: `kv_seq_len` for sliced calls, else `seq_len`."""
    return self.kv_seq_len if self.sliced else self.seq_len

  @property
  def num_k_blocks(self) -> int:
    return self.key_len // self.block_k


def split_alpha(refs: Sequence, cfg: Config) -> tuple[tuple, Sequence]:
  """A kernel's refs -> ((alpha_q, alpha_k, alpha_v) refs, or Nones without mixing, the rest)."""
  if cfg.mixing:
    return tuple(refs[:3]), refs[3:]
  return (None, None, None), refs


# --- Block ranges: which tiles the causal / bidirectional, window band touches. -----------
# Tile i of queries covers virtual rows [i*bq*P, (i+1)*bq*P) of the queries' sequence,
# rows [(offset + i*bq)*P, ...) of the keys' (sliced calls); tile j of keys covers
# [j*bk*P, (j+1)*bk*P). `xp` is jnp for traced grid/loop indices and np for static band
# widths. Unsliced indices are non-negative, so truncating division (lax.div: Triton-safe)
# is floor division; with an offset the rows may fall before the other axis' start, so the
# divisions there only ever see non-negative values (`signed`).


def _div(x, d: int, xp):
  return x // d if xp is np else lax.div(x, jnp.int32(d))


def _reach(cfg: Config, ahead: bool) -> int | None:
  """How far (virtual rows) a query sees keys behind it, or ahead of it; None = unbounded.

  Causal: nothing ahead, `window - 1` behind. Bidirectional: `window - 1` both ways.
  """
  if ahead and cfg.causal:
    return 0
  return None if cfg.window is None else cfg.window - 1


def _overlap(first, last, before, after, block: int, count: int, xp, signed: bool = False):
  """Tiles [lo, hi) of `block` rows (`count` tiles) meeting rows [first - before, last + after]
  (an empty range, lo >= hi, when they miss every tile; `signed`: first, last may be < 0)."""
  lo = 0 * first if before is None else _div(xp.maximum(0, first - before), block, xp)
  if after is None:
    hi = 0 * first + count
  elif signed:  # (x + block) // block = x // block + 1 for x >= -1; 0 for rows before 0
    hi = xp.minimum(count, _div(xp.maximum(last + after, -1) + block, block, xp))
  else:
    hi = xp.minimum(count, _div(last + after, block, xp) + 1)
  return lo, hi


def _no_offset(offset) -> bool:
  return offset is None or (isinstance(offset, int) and offset == 0)


def kv_range(i, cfg: Config, offset=None, xp=jnp):
  """Key tiles [lo, hi) visible to query tile i; `offset`: the query offset in tokens (an
  int, or an int32 scalar read by a sliced kernel; None: 0)."""
  bqv, bkv = cfg.block_q * cfg.num_pseudo, cfg.block_k * cfg.num_pseudo
  behind, ahead = _reach(cfg, ahead=False), _reach(cfg, ahead=True)
  if _no_offset(offset):
    return _overlap(i * bqv, (i + 1) * bqv - 1, behind, ahead, bkv, cfg.num_k_blocks, xp)
  first = (i * cfg.block_q + offset) * cfg.num_pseudo
  return _overlap(first, first + bqv - 1, behind, ahead, bkv, cfg.num_k_blocks, xp, True)


def q_range(j, cfg: Config, offset=None, xp=jnp):
  """Query tiles [lo, hi) that see key tile j (kv_range's reaches, mirrored)."""
  bqv, bkv = cfg.block_q * cfg.num_pseudo, cfg.block_k * cfg.num_pseudo
  behind, ahead = _reach(cfg, ahead=False), _reach(cfg, ahead=True)
  if _no_offset(offset):
    return _overlap(j * bkv, (j + 1) * bkv - 1, ahead, behind, bqv, cfg.num_q_blocks, xp)
  first = (j * cfg.block_k - offset) * cfg.num_pseudo
  return _overlap(first, first + bkv - 1, ahead, behind, bqv, cfg.num_q_blocks, xp, True)


# --- Pseudo tiles: mixing and RoPE on chip. ------------------------------------------------


def coefficient(alpha_ref, side: Side, m, p, cfg: Config) -> jax.Array:
  """alpha[m, target, p] from the flat `[targets * sources * P]` layout (target, m may be
  traced)."""
  return alpha_ref[(side.target * side.sources + m) * cfg.num_pseudo + p]


def pseudo_tile(
  load: Callable[[jax.Array | int], Parts], alpha_ref, side: Side, cfg: Config
) -> list[Parts]:
  """P pseudo pieces of target head t = `side.target`: `piece[p] = sum_m alpha[m,t,p] *
  source[m]` over the `side.sources` source heads, float32.

  `load(m)` returns source head m's tile as lane parts. Without mixing (MHA), the
  single piece is source head t itself.
  """
  if not cfg.mixing:
    return [tuple(x.astype(jnp.float32) for x in load(side.target))]

  def add_source(m, pieces):
    src = [x.astype(jnp.float32) for x in load(m)]
    return tuple(
      tuple(acc + coefficient(alpha_ref, side, m, p, cfg) * x for acc, x in zip(piece, src))
      for p, piece in enumerate(pieces)
    )

  first = [x.astype(jnp.float32) for x in load(0)]
  pieces = tuple(
    tuple(coefficient(alpha_ref, side, 0, p, cfg) * x for x in first) for p in range(cfg.num_pseudo)
  )
  return list(lax.fori_loop(1, side.sources, add_source, pieces))


def rotate(parts: Parts, cos: jax.Array, sin: jax.Array, *, transpose: bool = False) -> Parts:
  """Rotate-half RoPE on lane halves `(x1, x2)` by float32 tables broadcastable to them;
  `transpose` applies R^T (the VJP)."""
  sin = -sin if transpose else sin
  x1, x2 = parts
  return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def rotated_pieces(load, alpha_ref, side: Side, rotation, cfg: Config, dtype) -> list[Parts]:
  """Pseudo q or k pieces, each rotated by its pseudo index p (`rotation(p)` -> cos, sin
  `[1, half]`), cast to the matmul dtype."""
  pieces = pseudo_tile(load, alpha_ref, side, cfg)
  if cfg.rope:
    pieces = [rotate(piece, *rotation(p)) for p, piece in enumerate(pieces)]
  return [tuple(x.astype(dtype) for x in piece) for piece in pieces]


def plain_pieces(load, alpha_ref, side: Side, cfg: Config, dtype) -> list[Parts]:
  """Pseudo v pieces (no RoPE), cast to the matmul dtype."""
  pieces = pseudo_tile(load, alpha_ref, side, cfg)
  return [tuple(x.astype(dtype) for x in piece) for piece in pieces]


# --- Attention on one (query tile, key tile) pair. ------------------------------------------


def _precision(dtype) -> lax.Precision:
  # float32 inputs get true float32 matmuls (TPU DEFAULT would round to bf16).
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """2-D matmul contracting a's axis contract[0] with b's axis contract[1], float32 result."""
  return lax.dot_general(
    a,
    b,
    (((contract[0],), (contract[1],)), ((), ())),
    precision=_precision(a.dtype),
    preferred_element_type=jnp.float32,
  )


def scores(q: Parts, k: Parts, cfg: Config) -> jax.Array:
  """`[bq, bk]` scaled scores of one piece pair (sum over the lane parts)."""
  return sum(dot(a, b, (1, 1)) for a, b in zip(q, k)) * cfg.scale


MaskFn = Callable[[int, int], jax.Array]
SoftmaxState = list[tuple[jax.Array, jax.Array, jax.Array]]  # per query piece: (m, l, acc)


def init_state(pieces: int, rows: int, width: int) -> SoftmaxState:
  """Empty online-softmax state of `pieces` query pieces of `[rows, width]`."""
  return [
    (
      jnp.full((rows, 1), MASK_VALUE, jnp.float32),
      jnp.zeros((rows, 1), jnp.float32),
      jnp.zeros((rows, width), jnp.float32),
    )
    for _ in range(pieces)
  ]


def forward_tile(
  state: SoftmaxState,
  q: Sequence[Parts],
  k: Sequence[Parts],
  v: Sequence[Parts],
  mask: MaskFn,
  cfg: Config,
) -> SoftmaxState:
  """One online-softmax step of every query piece against every key piece."""
  out = []
  for pq, (m_prev, l_prev, acc_prev) in enumerate(state):
    masks = [mask(pq, pk) for pk in range(len(k))]
    s = [jnp.where(mk, scores(q[pq], k[pk], cfg), MASK_VALUE) for pk, mk in enumerate(masks)]
    m_new = m_prev
    for s_pk in s:
      m_new = jnp.maximum(m_new, jnp.max(s_pk, axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_new)
    l_new, acc_new = l_prev * correction, acc_prev * correction
    for pk, (s_pk, mk) in enumerate(zip(s, masks)):
      # Explicit zeros: a row with no visible key yet must not count masked keys.
      p = jnp.where(mk, jnp.exp(s_pk - m_new), 0.0)
      l_new += jnp.sum(p, axis=1, keepdims=True)
      acc_new += dot(p.astype(v[pk][0].dtype), v[pk][0], (1, 0))
    out.append((m_new, l_new, acc_new))
  return out


def finalize(state: SoftmaxState, seg_q: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
  """Per query piece: (output `[bq, Wv]` float32, lse `[bq, 1]`); padding rows output 0."""
  out = []
  for m, l, acc in state:
    l_safe = jnp.where(l == 0.0, 1.0, l)
    out.append((jnp.where(seg_q != 0, acc / l_safe, 0.0), m + jnp.log(l_safe)))
  return out


def probs_and_grads(
  q: Parts,
  k: Parts,
  v: Parts,
  do: jax.Array,
  lse: jax.Array,
  delta: jax.Array,
  mask: jax.Array,
  cfg: Config,
) -> tuple[jax.Array, jax.Array]:
  """FlashAttention-2 backward tile: probabilities p and score gradients ds, `[bq, bk]` f32.

  ds already carries the softmax scale, so `dq = ds @ k` and `dk = ds^T @ q`.
  """
  p = jnp.where(mask, jnp.exp(scores(q, k, cfg) - lse), 0.0)
  dp = dot(do, v[0], (1, 1))
  return p, p * (dp - delta) * cfg.scale


def scatter_to_sources(
  grads: Sequence[Parts],
  load: Callable[[jax.Array | int], Parts],
  add_to_source: Callable[[jax.Array | int, Parts], None],
  alpha_ref,
  dalpha_ref,
  side: Side,
  cfg: Config,
) -> None:
  """Backward of `pseudo_tile` for target head t = `side.target`, contracted on chip (no
  P-sized output).

  `grads[p]` is the float32 gradient of pseudo piece p (before RoPE). Adds
  `sum_p alpha[m,t,p] * grads[p]` to source head m through `add_to_source(m, parts)`
  and writes this tile's partial `<source[m], grads[p]>` of `dalpha[m,t,p]` into slot
  `side.slot` of the flat `dalpha_ref` (`[slots * sources * P]`; summed over tiles, batch
  and, for grouped keys and values, the slots of one target, outside the kernel).
  """
  if not cfg.mixing:
    add_to_source(side.target, grads[0])
    return

  def body(m, carry):
    src = [x.astype(jnp.float32) for x in load(m)]
    update = [
      sum(coefficient(alpha_ref, side, m, p, cfg) * g[c] for p, g in enumerate(grads))
      for c in range(len(src))
    ]
    add_to_source(m, tuple(update))
    for p, g in enumerate(grads):
      dalpha_ref[(side.slot * side.sources + m) * cfg.num_pseudo + p] = sum(
        jnp.sum(x * gc) for x, gc in zip(src, g)
      )
    return carry

  lax.fori_loop(0, side.sources, body, 0)
