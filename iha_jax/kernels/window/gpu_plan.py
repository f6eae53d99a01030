"""The static tiling of IHA's on-chip GPU window path (`iha_jax.kernels.window.gpu`), and
its band in the tiling's units.

`tiling` turns a call's shapes and options into a `Plan`: query tiles and key groups of
whole tokens whose pseudo rows (and source rows) are padded to powers of two (Triton's
block shapes), as many tokens as fill them within register budgets, or
`GpuUnsupportedShape` naming the limit; `backward_plan` pads them to whole spans of the
backward's programs. `key_groups`, `query_tiles` and `visible` are the band (`in_band`)
per query tile, per key group and per pseudo row, as the kernels ask it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from iha_jax.core.options import AttentionOptions, round_up
from iha_jax.kernels.gpu import MIN_BLOCK, block_pow2
from iha_jax.kernels.window.common import UnsupportedShape, WindowShape, in_band, window_shape

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
# Output rows per collapse product: bounds the float32 result the registers hold.
COLLAPSE_ROWS = 64
# Programs per batch row of each backward kernel (one per H100 SM): each takes `span`
# consecutive tiles, so the weights' partials are this many per batch row. (Two waves
# spilled in dQ at the 2.4B layer's shape under jax 0.10.2: docs/compile_checks.md.)
PROGRAMS = 132


class GpuUnsupportedShape(UnsupportedShape):
  """A call the on-chip GPU window path cannot take."""

  implementation = "pallas_gpu_window"
  path = "IHA's on-chip GPU window path"
  fallback = "pallas_gpu"


@dataclasses.dataclass(frozen=True)
class Plan(WindowShape):
  """The static tiling of one call (hashable: a custom_vjp argument). Rows are pseudo
  (virtual) rows of one head, `src` rows source rows `(n, m)`, tokens tokens."""

  half: int  # lanes of a RoPE half (d/2 padded to a power of two >= 16)
  width: int  # lanes of v and the output (d padded likewise)
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


def _check_rows(rows: int | None, name: str, p: int) -> None:
  if rows is not None and (rows < MIN_BLOCK or rows & (rows - 1) or rows < p):
    raise GpuUnsupportedShape(
      f"block_sizes.{name}={rows}: its tiles are powers of two >= 16 pseudo rows and >= P = {p}"
    )


def tiling(
  q_shape: tuple[int, ...],
  key_tokens: int,
  kv_heads: int,
  alphas_shape: tuple[tuple[int, ...], ...],
  collapse_shape: tuple[int, ...],
  options: AttentionOptions,
  offset,
  block_q: int | None = None,
  block_k: int | None = None,
) -> Plan:
  """The tiling of a call, or `GpuUnsupportedShape` naming the limit."""
  refusal = GpuUnsupportedShape
  shape = window_shape(
    q_shape, kv_heads, alphas_shape, collapse_shape, options, offset, MAX_HEAD_DIM, refusal
  )
  n, h, p = q_shape[1], shape.heads, shape.num_pseudo
  if p > 128:
    raise GpuUnsupportedShape(f"P = {p}: a token's pseudo rows must fit a 128-row tile")
  _check_rows(block_q, "block_q", p)
  _check_rows(block_k, "block_k", p)
  # Query tile: the requested rows, else QUERY_ROWS, halved while the mixing product's
  # source rows exceed the register budget.
  q_rows = block_q or max(QUERY_ROWS, block_pow2(p))
  src = lambda rows, heads: block_pow2(rows // p * heads)
  while block_q is None and src(q_rows, h) > MAX_QUERY_SOURCE_ROWS and q_rows > block_pow2(p):
    q_rows //= 2
  if src(q_rows, h) > MAX_QUERY_SOURCE_ROWS:
    raise GpuUnsupportedShape(
      f"a query tile of {q_rows} rows at P = {p} holds {q_rows // p * h} source rows "
      f"(H = {h}), over {MAX_QUERY_SOURCE_ROWS}"
    )
  # Key groups: the fullest (fewest padding rows), then the longest, within the budget.
  fits = [r for r in ([block_k] if block_k else KEY_ROWS) if r >= p]
  fits = [r for r in fits if src(r, kv_heads) <= MAX_KEY_SOURCE_ROWS]
  if block_k is None:
    fits = [r for r in fits if r * src(r, kv_heads) <= MAX_KEY_MIXING] or fits[-1:]
  if not fits:
    raise GpuUnsupportedShape(
      f"no key group of {block_k or KEY_ROWS} rows at P = {p} holds at most "
      f"{MAX_KEY_SOURCE_ROWS} source rows (G = {kv_heads})"
    )
  k_rows = max(fits, key=lambda r: (r // p * p / r, r))
  q_tokens, k_tokens = q_rows // p, k_rows // p
  return Plan(
    **dataclasses.asdict(shape),
    half=block_pow2(shape.head_dim // 2),
    width=block_pow2(shape.head_dim),
    offset=offset,
    q_tokens=q_tokens,
    q_rows=q_rows,
    q_src=src(q_rows, h),
    out_rows=block_pow2(q_tokens * shape.out_heads),
    k_tokens=k_tokens,
    k_rows=k_rows,
    k_src=src(k_rows, kv_heads),
    num_q=-(-n // q_tokens),
    num_k=-(-key_tokens // k_tokens),
  )


def backward_plan(plan: Plan) -> tuple[Plan, int, int]:
  """(the plan with query tiles and key groups padded to whole spans, query tiles per dQ
  program, key groups per dK/dV program). The padding tiles hold padding rows only."""
  q_span, k_span = -(-plan.num_q // PROGRAMS), -(-plan.num_k // PROGRAMS)
  padded = dataclasses.replace(
    plan, num_q=round_up(plan.num_q, q_span), num_k=round_up(plan.num_k, k_span)
  )
  return padded, q_span, k_span


def key_groups(plan: Plan, i):
  """Key groups `[lo, hi)` that query tile `i`'s window reaches."""
  p, w = plan.num_pseudo, plan.window
  first = (plan.offset + i * plan.q_tokens) * p
  last = first + plan.q_tokens * p - 1
  low = jnp.maximum(first - (w - 1), 0)
  high = last if plan.causal else last + w - 1
  lo = lax.div(lax.div(low, p), plan.k_tokens)
  hi = jnp.minimum(lax.div(lax.div(high, p), plan.k_tokens) + 1, plan.num_k)
  return lo, jnp.maximum(hi, lo)


def query_tiles(plan: Plan, j):
  """Query tiles `[lo, hi)` whose window reaches key group `j` (the transpose of
  `key_groups`)."""
  p, w = plan.num_pseudo, plan.window
  first = j * plan.k_tokens * p
  last = first + plan.k_tokens * p - 1
  low = first if plan.causal else jnp.maximum(first - (w - 1), 0)
  low_token = jnp.maximum(lax.div(low, p) - plan.offset, 0)
  high_token = lax.div(last + w - 1, p) - plan.offset
  lo = lax.div(low_token, plan.q_tokens)
  hi = jnp.minimum(lax.div(jnp.maximum(high_token, 0), plan.q_tokens) + 1, plan.num_q)
  hi = jnp.where(high_token < 0, lo, hi)
  return lo, jnp.maximum(hi, lo)


def visible(plan: Plan, t, u, qid, kid, *, transposed: bool = False) -> jax.Array:
  """`[len(t), len(u)]` (`[len(u), len(t)]` if transposed): query rows t see key rows u
  (virtual indices; `in_band`, then segments: `kid()` loads the key ids where they are
  used)."""
  delta = t[None, :] - u[:, None] if transposed else t[:, None] - u[None, :]
  ok = in_band(delta, plan.window, plan.causal)
  return ok & (qid[None, :] == kid()[:, None] if transposed else qid[:, None] == kid()[None, :])
