"""Sliding-window IHA on GPU with the pseudo-heads made, attended and collapsed on chip.

The GPU twin of `iha_jax.kernels.tpu_window` (same signature and semantics). The
materialised pipeline (`iha_jax.kernels.flash.attention`, "pallas_gpu") writes pseudo
q/k/v and the pseudo output to HBM, four arrays P times the layer's own activations; a
window layer attends a band of only ~W virtual keys per query, so that traffic bounds
it. Here one Triton program takes a tile of query tokens and, per target head, mixes
its pseudo queries, walks the band's key groups mixing their pseudo keys and values,
attends them with an online softmax and collapses the head's output into the tile's
rows (`gpu_window_kernel`): only source-sized arrays cross HBM in the forward.

How the work maps to the tensor cores (every product a matmul):
- *Mixing* of a group of `s` tokens is `kron(I_s, alpha[:, t, :]^T)` `[s*P, s*S]`
  times the group's source rows `(n, m)` `[s*S, d]` (as in tpu_window). Triton's block
  shapes are powers of two, so a group's `s*P` pseudo rows are padded with zero rows to
  `q_rows` / `k_rows` (masked by their ids) and its `s*S` source rows with zero rows to
  `q_src` / `k_src`. `s` is as many tokens as fill the rows within register budgets
  (`plan`): at P = H = 20, 3 tokens fill 60 of a 64-row query tile and one token 20 of
  a 32-row key group; at P = 4, 8 tokens fill a 32-row query tile and 4 a 16-row group.
- *RoPE* at virtual position `pos * P + p` is `R(p) R(pos * P)`: the source heads are
  rotated at `pos * P` in XLA (source-sized), the pseudo rows by `R(p)` on chip from a
  per-row cos/sin table (period P). The sources come in two d/2 halves, so rotation is
  elementwise and the scores are `q1 k1^T + q2 k2^T`: no lane concatenation in
  registers.
- *Attention*: flash attention over the key groups of the tile's band (float32 online
  softmax), the mask from virtual indices made from iotas, and per-row segment ids
  (-1 for padding keys and rows, 0 for padding queries) compared once.
- *Collapse*: the head's normalised pseudo output times a block-diagonal constant
  `[out_rows, q_rows]`, added into the tile's output rows `(n, ho)` in chunks of
  `COLLAPSE_ROWS` (read-modify-write in the program's own output block, a barrier
  between heads): the float32 output of every target head need not sit in registers
  at once (at P = 4, H = 20 a 16-token tile has 320 output rows).

Layouts: source rows token-group-major (`gpu_window_kernel`'s docstring); the output
y `[B, N, Ho, d]` is float32 (Ho = H, or the local target heads of a per-head collapse;
a full collapse over a head shard is a partial sum).

The backward is on chip too (`gpu_window_backward`): the custom VJP saves only the
call's own arrays (nothing P-sized; the forward's softmax is run again), and three
kernels (statistics, dQ, dK/dV) remake the pseudo tiles from the source-sized operands
and write source-row gradients and per-program partial gradients of the mixing and
collapse matrices, folded to the weights' shapes (summed in XLA). Only two float32
numbers per pseudo query row and target head (`lse`, `delta` `[B, Ht, N*P]`, 2/d of a
P-sized array) cross HBM between them. `sources`' transpose (padding, halves,
`R(pos * P)^T`) takes the row gradients back to q, k, v. The materialised pipeline is
no longer reached: every call the forward takes, the backward takes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from iha_jax.core.options import AttentionOptions
from iha_jax.core.rope import apply_rope, rope_frequencies
from iha_jax.core.validation import default_positions
from iha_jax.kernels import gpu_window_backward, gpu_window_kernel
from iha_jax.kernels.flash.attention import key_side
from iha_jax.kernels.gpu import MIN_BLOCK as MIN_LANES
from iha_jax.kernels.gpu import next_pow2

# Default query tile: pseudo rows per target head and program.
QUERY_ROWS = 64
# Key groups: pseudo rows per online-softmax step (candidates, the fullest wins).
KEY_ROWS = (64, 32, 16)
# Source rows a tile's mixing product contracts over (register budget of its operands).
MAX_QUERY_SOURCE_ROWS = 256
MAX_KEY_SOURCE_ROWS = 128
# A key group's mixing product `[k_rows, k_src]` at most this many elements: with the
# online softmax's tiles it fits H100's registers at d = 128 (at P = H = 20, 64-row
# groups of 3 tokens spilled; 32-row groups of one token, 20 rows used, do not).
MAX_KEY_MIXING = 2048
MAX_HEAD_DIM = 128
IMPLEMENTATION = "pallas_gpu_window"


class UnsupportedShape(ValueError):
  """A call the on-chip GPU window path cannot take (the materialised pipeline can): one
  line naming the limit and the implementation that takes the call."""

  def __init__(self, limit: str):
    super().__init__(
      f"implementation '{IMPLEMENTATION}' (IHA's on-chip GPU window path): {limit}; use "
      "'pallas_gpu' (the materialised pipeline) or 'auto'"
    )


@dataclasses.dataclass(frozen=True)
class WindowPlan:
  """The static tiling of one call (hashable: a custom_vjp argument). Rows are pseudo
  (virtual) rows of one head, `src` rows source rows `(n, m)`, tokens tokens."""

  heads: int  # H: source query heads
  kv_heads: int  # G: source key/value heads
  out_heads: int  # Ho: collapsed heads the call outputs
  targets: int  # Ht: target query heads computed here
  kv_targets: int  # Gt: target key/value heads computed here
  num_pseudo: int  # P
  head_dim: int  # d
  half: int  # lanes of a RoPE half (d/2 padded to a power of two >= 16)
  width: int  # lanes of v and the output (d padded likewise)
  window: int  # virtual rows
  causal: bool
  per_head: bool  # collapse [Ht, P] (else [Ho, Ht, P])
  rotary: bool
  offset: int  # static query offset (tokens) on the keys' axis
  q_tokens: int  # tokens per query tile
  q_rows: int  # its pseudo rows (power of two)
  q_src: int  # its source rows (power of two)
  out_rows: int  # its output rows (n, ho) (power of two)
  k_tokens: int  # tokens per key group
  k_rows: int
  k_src: int
  num_q: int  # query tiles
  num_k: int  # key groups

  @property
  def mix_values_late(self) -> bool:
    """Whether a step's values enter as `(probs @ av) @ v` rather than `probs @ (av @ v)`:
    the fewer products (at P = H = 20 the first; at P = 4 with 16-row key groups of 128
    source rows, the second)."""
    late = self.q_rows * self.k_rows * self.k_src + self.q_rows * self.k_src * self.width
    early = self.k_rows * self.k_src * self.width + self.q_rows * self.k_rows * self.width
    return late <= early


def _pow2(x: int) -> int:
  return max(MIN_LANES, next_pow2(x))


def _check_rows(rows: int | None, name: str, p: int) -> None:
  if rows is not None and (rows < MIN_LANES or rows & (rows - 1) or rows < p):
    raise UnsupportedShape(
      f"block_sizes.{name}={rows}: its tiles are powers of two >= 16 pseudo rows and >= P = {p}"
    )


def plan(
  q_shape: tuple[int, ...],
  key_tokens: int,
  kv_heads: int,
  alphas_shape: tuple[tuple[int, ...], ...],
  collapse_shape: tuple[int, ...],
  options: AttentionOptions,
  offset,
  block_q: int | None = None,
  block_k: int | None = None,
) -> WindowPlan:
  """The tiling of a call, or `UnsupportedShape` naming the limit."""
  _, n, h, d = q_shape
  if options.window is None:
    raise UnsupportedShape("it takes sliding windows only (window=None is a global layer)")
  if not isinstance(offset, int):
    raise UnsupportedShape("it needs a static query offset (a window layer's shard has one)")
  (_, ht, p), (_, gt, _) = alphas_shape[0], alphas_shape[1]
  per_head = len(collapse_shape) == 2
  ho = ht if per_head else collapse_shape[0]
  if d % 2 or d > MAX_HEAD_DIM:
    raise UnsupportedShape(f"head_dim {d}: it takes an even head_dim <= {MAX_HEAD_DIM}")
  if p > 128:
    raise UnsupportedShape(f"P = {p}: a token's pseudo rows must fit a 128-row tile")
  _check_rows(block_q, "block_q", p)
  _check_rows(block_k, "block_k", p)
  # Query tile: the requested rows, else QUERY_ROWS, halved while the mixing product's
  # source rows exceed the register budget.
  q_rows = block_q or max(QUERY_ROWS, _pow2(p))
  src = lambda rows, heads: _pow2(rows // p * heads)
  while block_q is None and src(q_rows, h) > MAX_QUERY_SOURCE_ROWS and q_rows > _pow2(p):
    q_rows //= 2
  if src(q_rows, h) > MAX_QUERY_SOURCE_ROWS:
    raise UnsupportedShape(
      f"a query tile of {q_rows} rows at P = {p} holds {q_rows // p * h} source rows "
      f"(H = {h}), over {MAX_QUERY_SOURCE_ROWS}"
    )
  # Key groups: the fullest (fewest padding rows), then the longest, within the budget.
  fits = [r for r in ([block_k] if block_k else KEY_ROWS) if r >= p]
  fits = [r for r in fits if src(r, kv_heads) <= MAX_KEY_SOURCE_ROWS]
  if block_k is None:
    fits = [r for r in fits if r * src(r, kv_heads) <= MAX_KEY_MIXING] or fits[-1:]
  if not fits:
    raise UnsupportedShape(
      f"no key group of {block_k or KEY_ROWS} rows at P = {p} holds at most "
      f"{MAX_KEY_SOURCE_ROWS} source rows (G = {kv_heads})"
    )
  k_rows = max(fits, key=lambda r: (r // p * p / r, r))
  q_tokens, k_tokens = q_rows // p, k_rows // p
  return WindowPlan(
    heads=h,
    kv_heads=kv_heads,
    out_heads=ho,
    targets=ht,
    kv_targets=gt,
    num_pseudo=p,
    head_dim=d,
    half=_pow2(d // 2),
    width=_pow2(d),
    window=options.window,
    causal=options.causal,
    per_head=per_head,
    rotary=options.rope_theta is not None,
    offset=offset,
    q_tokens=q_tokens,
    q_rows=q_rows,
    q_src=src(q_rows, h),
    out_rows=_pow2(q_tokens * ho),
    k_tokens=k_tokens,
    k_rows=k_rows,
    k_src=src(k_rows, kv_heads),
    num_q=-(-n // q_tokens),
    num_k=-(-key_tokens // k_tokens),
  )


# --- operands built in XLA (source-sized, or small constants) -----------------------------


def _pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _group_rows(x: jax.Array, tokens: int, groups: int, rows: int) -> jax.Array:
  """`[B, T, S, w]` -> `[B, groups * rows, w]`: groups of `tokens` tokens, each group's
  rows `(n, m)` padded with zero rows to `rows`."""
  b, _, s, w = x.shape
  x = _pad_to(x, 1, groups * tokens).reshape(b, groups, tokens * s, w)
  return _pad_to(x, 2, rows).reshape(b, groups * rows, w)


def _halves(x: jax.Array, lanes: int) -> tuple[jax.Array, jax.Array]:
  half = x.shape[-1] // 2
  return _pad_to(x[..., :half], -1, lanes), _pad_to(x[..., half:], -1, lanes)


def _block_diagonal(weights: jax.Array, s: int, rows: int, cols: int) -> jax.Array:
  """`weights [S, T, P]` -> `[T, rows, cols]`: per target t, `kron(I_s, weights[:, t, :]^T)`
  (rows (n, p), columns (n', m)) padded with zeros."""
  out = jnp.einsum("nN,mtp->tnpNm", jnp.eye(s, dtype=weights.dtype), weights)
  t, _, p, _, m = out.shape
  return _pad_to(_pad_to(out.reshape(t, s * p, s * m), 1, rows), 2, cols)


def _collapse_blocks(collapse: jax.Array, plan: WindowPlan) -> jax.Array:
  """`collapse` -> `[Ht, out_rows, q_rows]`: per target head h', rows (n, ho), columns
  (n', p), `delta(n, n') collapse[ho, h', p]` (per head: only ho = h')."""
  if plan.per_head:
    collapse = jnp.einsum("hp,hg->hgp", collapse, jnp.eye(plan.targets, dtype=collapse.dtype))
  s = plan.q_tokens
  blocks = _block_diagonal(collapse, s, s * plan.num_pseudo, s * plan.out_heads)
  blocks = jnp.swapaxes(blocks, 1, 2)  # [Ht, s*Ho, s*P]
  return _pad_to(_pad_to(blocks, 1, plan.out_rows), 2, plan.q_rows)


def _rope_rows(plan: WindowPlan, tokens: int, rows: int, theta: float):
  """(cos, sin) `[rows, half]` float32 of `R(p)` for a group's pseudo rows (n, p)."""
  p = plan.num_pseudo
  pseudo = jnp.tile(jnp.arange(p, dtype=jnp.float32), tokens)[:, None]
  angles = pseudo * rope_frequencies(plan.head_dim, theta)
  return tuple(_pad_to(_pad_to(f(angles), 0, rows), 1, plan.half) for f in (jnp.cos, jnp.sin))


def _row_ids(ids: jax.Array, p: int, tokens: int, groups: int, rows: int, padding: int):
  """Token ids `[B, T]` -> per pseudo row `[B, groups * rows]` (padding: `padding`)."""
  b = ids.shape[0]
  ids = _pad_to(ids.astype(jnp.int32), 1, groups * tokens, padding)
  ids = jnp.repeat(ids, p, axis=1).reshape(b, groups, tokens * p)
  return _pad_to(ids, 2, rows, padding).reshape(b, groups * rows)


def sources(q, k, v, options: AttentionOptions, plan: WindowPlan) -> dict:
  """The kernels' source rows (linear in q, k, v: the backward transposes it): q1, q2,
  k1, k2 rotated by `R(pos * P)` in two halves, v; token groups padded to whole rows."""
  if plan.rotary:  # R(pos * P) on the source heads; R(p) per pseudo row on chip
    positions = default_positions(q, options.positions)
    _, key_positions = key_side(q, k, options)
    q = apply_rope(q, positions * plan.num_pseudo, options.rope_theta)
    k = apply_rope(k, key_positions * plan.num_pseudo, options.rope_theta)
  q = _group_rows(q, plan.q_tokens, plan.num_q, plan.q_src)
  k = _group_rows(k, plan.k_tokens, plan.num_k, plan.k_src)
  v = _pad_to(_group_rows(v, plan.k_tokens, plan.num_k, plan.k_src), -1, plan.width)
  (q1, q2), (k1, k2) = _halves(q, plan.half), _halves(k, plan.half)
  return dict(q1=q1, q2=q2, k1=k1, k2=k2, v=v)


def prepare(q, k, v, alphas, collapse, options: AttentionOptions, plan: WindowPlan) -> dict:
  """The kernels' operands (`gpu_window_kernel`): `sources`, the block-diagonal
  constants, RoPE tables and per-row ids."""
  p = plan.num_pseudo
  positions = default_positions(q, options.positions)
  key_ids, _ = key_side(q, k, options)
  operands = sources(q, k, v, options, plan)
  dtype = q.dtype
  alpha_q, alpha_k, alpha_v = (a.astype(jnp.float32) for a in alphas)
  scale = 1 / math.sqrt(plan.head_dim)  # the softmax scale rides on the queries
  operands["aq"] = _block_diagonal(alpha_q * scale, plan.q_tokens, plan.q_rows, plan.q_src)
  operands["ak"] = _block_diagonal(alpha_k, plan.k_tokens, plan.k_rows, plan.k_src)
  operands["av"] = _block_diagonal(alpha_v, plan.k_tokens, plan.k_rows, plan.k_src)
  operands["cm"] = _collapse_blocks(collapse.astype(jnp.float32), plan)
  for name in ("aq", "ak", "av", "cm"):
    operands[name] = operands[name].astype(dtype)
  if plan.rotary:
    theta = options.rope_theta
    operands["cos_q"], operands["sin_q"] = _rope_rows(plan, plan.q_tokens, plan.q_rows, theta)
    operands["cos_k"], operands["sin_k"] = _rope_rows(plan, plan.k_tokens, plan.k_rows, theta)
  query_ids = options.segment_ids
  if query_ids is None:
    query_ids = jnp.ones(q.shape[:1] + (positions.shape[1],), jnp.int32)
  key_ids = jnp.where(key_ids == 0, -1, key_ids)
  operands["qid"] = _row_ids(query_ids, p, plan.q_tokens, plan.num_q, plan.q_rows, 0)
  operands["kid"] = _row_ids(key_ids, p, plan.k_tokens, plan.num_k, plan.k_rows, -1)
  return operands


# --- the call and its VJP -----------------------------------------------------------------


def _forward(plan: WindowPlan, operands: dict) -> jax.Array:
  """`forward_call`: compiled by Triton when lowering for cuda/rocm, Pallas' interpreter
  anywhere else (CPU tests)."""
  call = functools.partial(gpu_window_kernel.forward_call, plan)
  compiled = functools.partial(call, interpret=False)
  return lax.platform_dependent(
    operands, default=functools.partial(call, interpret=True), cuda=compiled, rocm=compiled
  )


def _outputs(plan: WindowPlan, options, q, k, v, alphas, collapse) -> jax.Array:
  b, n, _, d = q.shape
  y = _forward(plan, prepare(q, k, v, alphas, collapse, options, plan))
  y = y.reshape(b, plan.num_q, plan.out_rows, plan.width)[:, :, : plan.q_tokens * plan.out_heads]
  return y.reshape(b, -1, plan.out_heads, plan.width)[:, :n, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan: WindowPlan, options: AttentionOptions, q, k, v, alphas, collapse):
  """y `[B, N, Ho, d]` float32."""
  return _outputs(plan, options, q, k, v, alphas, collapse)


def _attend_fwd(plan, options, q, k, v, alphas, collapse):
  # Saved: the call's own arrays only (nothing P-sized).
  return _outputs(plan, options, q, k, v, alphas, collapse), (options, q, k, v, alphas, collapse)


def _attend_bwd(plan, residuals, dy):
  # On chip (`gpu_window_backward`): the kernels remake the pseudo tiles from the
  # source-sized operands (made again here, in XLA) and write source-row gradients, which
  # the transpose of `sources` (padding, halves, R(pos * P)) takes back to q, k, v.
  options, q, k, v, alphas, collapse = residuals
  padded, q_span, k_span = gpu_window_backward.backward_plan(plan)
  operands = prepare(q, k, v, alphas, collapse, options, padded)
  rows = _pad_to(dy, -1, plan.width).astype(q.dtype)
  operands["dy"] = _group_rows(rows, plan.q_tokens, padded.num_q, plan.out_rows)
  dq1, dq2, dk1, dk2, dv, *partials = gpu_window_backward.gradients(
    padded, q_span, k_span, operands
  )
  f32 = lambda x: x.astype(jnp.float32)
  _, transpose = jax.vjp(lambda *x: sources(*x, options, padded), f32(q), f32(k), f32(v))
  grads = transpose(dict(q1=dq1, q2=dq2, k1=dk1, k2=dk2, v=dv))
  scale = 1 / math.sqrt(plan.head_dim)
  *dalphas, dcollapse = gpu_window_backward.weight_grads(plan, scale, *partials)
  return (
    jax.tree.map(lambda _: None, options),
    *(g.astype(x.dtype) for g, x in zip(grads, (q, k, v))),
    tuple(g.astype(a.dtype) for g, a in zip(dalphas, alphas)),
    dcollapse.astype(collapse.dtype),
  )


_attend.defvjp(_attend_fwd, _attend_bwd)


def window_iha(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  options: AttentionOptions,
) -> jax.Array:
  """Sliding-window IHA on GPU (docs/design.md §8, the on-chip window paths) -> `[B, N,
  Ho, d]` float32: Ho = H for a full collapse `[H, Ht, P]` (a partial sum over the Ht
  local target heads), Ht for per_head `[Ht, P]`.

  q `[B, N, H, d]`, k and v `[B, Nk, G, d]` source heads (Nk = N unless a sequence shard,
  whose query offset must be static); `alphas = (alpha_q [H, Ht, P], alpha_k [G, Gt, P],
  alpha_v [G, Gt, P])`; `options`: a window (virtual rows), causal or not, segment ids,
  positions, RoPE, and `block_sizes`: `block_q` the pseudo rows of a query tile, `block_k`
  those of a key group (powers of two >= 16 and >= P). Raises `UnsupportedShape` (one
  line, naming the limit) for calls this path cannot take."""
  the_plan = plan_for(q, k, alphas, collapse, options)
  y = _attend(the_plan, options, q, k, v, tuple(alphas), collapse)
  if options.segment_ids is not None:  # padding queries output zeros
    y = jnp.where((options.segment_ids != 0)[:, :, None, None], y, 0.0)
  return y


def plan_for(q, k, alphas, collapse, options: AttentionOptions) -> WindowPlan:
  """The `WindowPlan` of a call (arrays or ShapeDtypeStructs)."""
  offset = options.query_offset if (options.sliced or k.shape[1] != q.shape[1]) else 0
  blocks = options.block_sizes
  return plan(
    q.shape,
    k.shape[1],
    k.shape[2],
    tuple(a.shape for a in alphas),
    collapse.shape,
    options,
    offset,
    blocks and blocks.block_q,
    blocks and blocks.block_k,
  )


def unsupported(q, v, num_pseudo: int, options: AttentionOptions) -> str | None:
  """Why the on-chip GPU window path cannot take a call of q `[B, N, H, d]` and v `[B, Nk,
  G, d]` at P pseudo-heads (full mixing and collapse), or None."""
  h, g = q.shape[2], v.shape[2]
  shape = lambda s: jax.ShapeDtypeStruct(s, jnp.float32)
  alphas = tuple(shape((x, x, num_pseudo)) for x in (h, g, g))
  try:
    plan_for(q, v, alphas, shape((h, h, num_pseudo)), options)
  except UnsupportedShape as error:
    return str(error)
  return None
