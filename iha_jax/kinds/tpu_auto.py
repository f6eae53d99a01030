"""What "auto" runs on TPU: the implementation libtpu's schedule estimates fastest.

`tpu_ranking.RANKING` (generated: `python benchmarks/tpu_estimate.py --write_ranking`)
holds, per shape class (kind, P, global or windowed), each TPU implementation's
*estimated* forward and forward+backward time on one v5p chip at the paper's shape
(docs/performance.md). `choose` takes the class nearest a call (same kind and mask, the
nearest P on a log scale) and returns its fastest implementation by forward+backward
time that the call can run: not "splash" for a sequence shard (a query offset: splash's
masks are static) nor above the materialisation limit (its autodiff saves P-sized pseudo
q/k/v). XLA's estimates are lower bounds (its band loops run a data-dependent number of
times), so it is never ranked.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from iha_jax.kinds import tpu_ranking

# A ranking row: (kind, P, windowed, implementation, estimated fwd ms, fwd+bwd ms).
Row = tuple[str, int, bool, str, float, float]


def classes() -> dict[tuple[str, int, bool], list[Row]]:
  """Ranking rows by shape class (kind, P, windowed), fastest forward+backward first."""
  found: dict[tuple[str, int, bool], list[Row]] = {}
  for row in tpu_ranking.RANKING:
    found.setdefault(row[:3], []).append(row)
  return {key: sorted(rows, key=lambda r: (r[5], r[4])) for key, rows in found.items()}


def choose(
  kind: str,
  num_pseudo: int,
  windowed: bool,
  available: Collection[str],
  *,
  sliced: bool,
  small: bool,
) -> str | None:
  """The fastest ranked implementation of the class nearest (kind, P, windowed) among
  `available`; "splash" only when the call is not `sliced` and materialises few enough
  bytes (`small`). None when no ranked class fits (the caller's own default then)."""
  candidates = [key for key in classes() if key[0] == kind and key[2] == windowed]
  if not candidates:
    candidates = [key for key in classes() if key[0] == kind]
  if not candidates:
    return None
  nearest = min(candidates, key=lambda key: abs(math.log(key[1]) - math.log(max(num_pseudo, 1))))
  for row in classes()[nearest]:
    name = row[3]
    if name not in available or (name == "splash" and (sliced or not small)):
      continue
    return name
  return None
