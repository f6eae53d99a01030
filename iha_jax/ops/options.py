"""Option types and tile arithmetic shared by every attention kind and implementation
(a leaf module).

`iha_jax.ops` (the public entry points) and `iha_jax.kernels` (the Pallas kernels)
both import from here and from nowhere else in `ops` that could import them back,
so the two packages form no import cycle.
"""

from __future__ import annotations

import dataclasses

# Every `implementation=` value the entry points accept. "auto" resolves per backend and
# kind (`iha_jax.ops.registry.resolve`).
IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu", "pallas_gpu", "auto")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile edges for the blockwise implementations (None = the implementation's default).

  In virtual tokens for IHA (tokens for the other kinds). The fused Pallas kernels tile
  whole tokens: their blocks must be multiples of P (token tile = block / P, used by the
  forward and both backward kernels), with GPU token tiles powers of two and TPU query
  tiles multiples of 8 (16 for 2-byte dtypes) and key tiles multiples of 128 tokens.
  The query-chunked XLA paths (talking-heads, 2-simplicial) read `block_q` only.
  """

  block_q: int | None = None
  block_k: int | None = None


def round_up(x: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= `x` (tile padding)."""
  return -(-x // multiple) * multiple
