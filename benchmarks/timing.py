"""Wall-clock timing shared by the benchmark scripts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def call_times(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
  """Seconds of each of `repeats` calls of `fn` (blocked until ready), after `warmup`
  untimed calls (compilation, first-touch allocations)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times
