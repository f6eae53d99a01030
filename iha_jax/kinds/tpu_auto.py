"""What "auto" runs on TPU: the implementation libtpu's schedule estimates fastest.

`tpu_ranking.RANKING` holds, per shape class (kind, P, global or windowed), each TPU
implementation's *estimated* forward and forward+backward time on one v5p chip at the
paper's shape. XLA's estimates are lower bounds (its band loops run a data-dependent
number of times), so it is never ranked.
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
  """The fastest (forward+backward) implementation among `available` of the ranked class
  nearest (kind, P, windowed): same kind and mask if ranked, the nearest P on a log scale.
  "splash" only when the call is not `sliced` (a sequence shard: splash's masks are
  static) and materialises few enough bytes (`small`: its autodiff saves the P-sized
  pseudo q/k/v). None when no ranked class fits (the caller's own default then)."""
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
