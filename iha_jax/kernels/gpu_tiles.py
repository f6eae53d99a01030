"""Launch parameters of the GPU (Triton) kernels: tile rows, warps and pipeline stages.

`TABLE` was chosen by compiling candidates for an H100 (SXM, sm_90a) without the GPU,
with XLA's deviceless compiler and ptxas 12.9: per kernel and shape, the largest tiles
(then the most warps) that compile with zero register spill bytes, causal with a window
and bidirectional with segment ids alike. Regenerate with
`python benchmarks/tune_gpu_tiles.py --write` (README "Compile checks"). These are static
choices, not timings: no kernel here has been timed on a GPU.
Chosen under jax 0.10.2's Triton; jax 0.12's allocates registers differently: its dK/dV
at Pr = 4, W = 64 spilled 8 bytes at 128 x 64 tiles (causal, window), so that key holds
its 0.12 choice, 64 x 64, spill-free under both (docs/compile_checks.md). Re-tune under
both sets (`make test-newest` builds the newest) and keep, per key, the smaller launch.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from iha_jax.core.options import round_up
from iha_jax.kernels.common import Config, next_pow2


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel's launch: tile rows (virtual tokens, powers of two), warps, stages."""

  rows_q: int
  rows_k: int
  num_warps: int
  num_stages: int


KERNELS = ("forward", "dq", "dkv")

# (kernel, rows per token Pr, lanes W, dtype) -> Launch. Lanes W = 2 * half width of the
# kernels' q/k layout (64 for d <= 64, 128 for d <= 128, ...).
TABLE: dict[tuple[str, int, int, str], Launch] = {
  ("dkv", 1, 64, "bfloat16"): Launch(128, 64, 8, 2),
  ("dkv", 1, 128, "bfloat16"): Launch(128, 32, 8, 2),
  ("dkv", 1, 256, "bfloat16"): Launch(32, 16, 8, 2),
  ("dkv", 2, 64, "bfloat16"): Launch(64, 64, 8, 2),
  ("dkv", 2, 128, "bfloat16"): Launch(32, 64, 8, 2),
  ("dkv", 4, 64, "bfloat16"): Launch(64, 64, 8, 2),
  ("dkv", 4, 128, "bfloat16"): Launch(32, 64, 8, 2),
  ("dkv", 4, 256, "bfloat16"): Launch(16, 32, 8, 2),
  ("dkv", 8, 64, "bfloat16"): Launch(128, 64, 8, 2),
  ("dkv", 8, 128, "bfloat16"): Launch(32, 64, 8, 2),
  ("dkv", 16, 128, "bfloat16"): Launch(32, 64, 8, 2),
  ("dkv", 32, 128, "bfloat16"): Launch(32, 64, 8, 2),
  ("dq", 1, 64, "bfloat16"): Launch(128, 64, 8, 2),
  ("dq", 1, 128, "bfloat16"): Launch(128, 64, 8, 2),
  ("dq", 1, 256, "bfloat16"): Launch(64, 32, 8, 2),
  ("dq", 2, 64, "bfloat16"): Launch(128, 64, 8, 2),
  ("dq", 2, 128, "bfloat16"): Launch(64, 32, 8, 2),
  ("dq", 4, 64, "bfloat16"): Launch(128, 64, 8, 2),
  ("dq", 4, 128, "bfloat16"): Launch(64, 32, 8, 2),
  ("dq", 4, 256, "bfloat16"): Launch(16, 32, 8, 2),
  ("dq", 8, 64, "bfloat16"): Launch(128, 64, 8, 2),
  ("dq", 8, 128, "bfloat16"): Launch(64, 32, 8, 2),
  ("dq", 16, 128, "bfloat16"): Launch(128, 32, 8, 2),
  ("dq", 32, 128, "bfloat16"): Launch(128, 32, 8, 2),
  ("forward", 1, 64, "bfloat16"): Launch(128, 128, 8, 2),
  ("forward", 1, 128, "bfloat16"): Launch(128, 64, 8, 2),
  ("forward", 1, 256, "bfloat16"): Launch(128, 32, 8, 2),
  ("forward", 2, 64, "bfloat16"): Launch(128, 128, 8, 2),
  ("forward", 2, 128, "bfloat16"): Launch(128, 64, 8, 2),
  ("forward", 4, 64, "bfloat16"): Launch(128, 128, 8, 2),
  ("forward", 4, 128, "bfloat16"): Launch(128, 64, 8, 2),
  ("forward", 4, 256, "bfloat16"): Launch(64, 32, 8, 2),
  ("forward", 8, 64, "bfloat16"): Launch(128, 128, 8, 2),
  ("forward", 8, 128, "bfloat16"): Launch(128, 64, 8, 2),
  ("forward", 16, 128, "bfloat16"): Launch(128, 64, 8, 2),
  ("forward", 32, 128, "bfloat16"): Launch(128, 64, 8, 2),
}

# Outside the table (float32; rarer widths and P): small tiles. They compile for every
# shape of docs/compile_matrix.md; float32 at W = 128 still spills (up to 1.7 KB).
FALLBACK = Launch(rows_q=64, rows_k=32, num_warps=8, num_stages=2)


def launches(num_pseudo: int, width: int, dtype) -> tuple[Launch, Launch, Launch]:
  """(forward, dQ, dK/dV) launches for P = num_pseudo, q/k lanes `width` and `dtype`."""
  pr = next_pow2(num_pseudo)
  name = jnp.dtype(dtype).name
  chosen = (TABLE.get((kernel, pr, width, name), FALLBACK) for kernel in KERNELS)
  # A tile holds at least one token's Pr rows.
  return tuple(
    dataclasses.replace(launch, rows_q=max(launch.rows_q, pr), rows_k=max(launch.rows_k, pr))
    for launch in chosen
  )


def tiled(
  cfg: Config, n: int, dtype, block_q: int | None, block_k: int | None, kv_tokens: int | None = None
) -> Config:
  """cfg with its tiles: the (forward, dQ, dK/dV) `launch`, the forward's block_q and
  block_k in tokens, and padded tokens `seq_len` (a multiple of every kernel's tiles), and,
  for a sliced call (`kv_tokens` keys, `cfg.sliced`), the padded keys `kv_seq_len`.

  `block_q`, `block_k`: tile rows (virtual tokens, powers of two >= 16 and >= Pr) for all
  three kernels, or None for the tuned table (`launches`).
  """
  rows = next_pow2(cfg.num_pseudo)
  width = max(cfg.width, cfg.value_width)
  chosen = launches(cfg.num_pseudo, width, jnp.dtype(dtype))
  for name, value in (("block_q", block_q), ("block_k", block_k)):
    if value is not None and (value & (value - 1) or value < max(16, rows)):
      raise ValueError(
        f"GPU kernels need power-of-two tiles of >= {max(16, rows)} virtual rows "
        f"(16, and P = {cfg.num_pseudo} rounded up to a power of two); {name} is {value}."
      )
  # Tiles no longer than the (power-of-two padded) sequence of their side.
  cap = lambda tokens: max(16, rows * next_pow2(max(1, tokens)))
  kv = n if kv_tokens is None else kv_tokens
  chosen = tuple(
    dataclasses.replace(
      launch,
      rows_q=min(block_q or launch.rows_q, cap(n)),
      rows_k=min(block_k or launch.rows_k, cap(kv)),
    )
    for launch in chosen
  )
  # Powers of two: the largest token tile is a multiple of the others.
  largest = lambda *sides: max(getattr(launch, s) for launch in chosen for s in sides) // rows
  if kv_tokens is None:
    lengths = dict(seq_len=round_up(n, largest("rows_q", "rows_k")))
  else:
    lengths = dict(
      seq_len=round_up(n, largest("rows_q")), kv_seq_len=round_up(kv_tokens, largest("rows_k"))
    )
  return dataclasses.replace(
    cfg,
    block_q=chosen[0].rows_q // rows,
    block_k=chosen[0].rows_k // rows,
    launch=chosen,
    **lengths,
  )


def kernel_config(cfg: Config, launch: Launch) -> Config:
  """cfg with this kernel's tiles (tokens per tile) for the band arithmetic."""
  rows = next_pow2(cfg.num_pseudo)
  return dataclasses.replace(cfg, block_q=launch.rows_q // rows, block_k=launch.rows_k // rows)
