"""Where one program's estimated time goes: the loop tree of a libtpu schedule.

    python benchmarks/tpu_estimate.py --cases window_p20 --implementations pallas_tpu_window \
        --passes fwd --keep_schedule sched/
    python benchmarks/schedule_profile.py sched/*/*iha_window_forward*-01-final_bundles.txt

Reads one `*final_bundles.txt` (a Mosaic kernel's or an XLA op's final VLIW schedule, kept
by `--keep_schedule` or `IHA_TPU_SCHEDULE_DIR`) and prints its loops as a tree: each
loop's trips, the bundles it issues in all (its own bundles times the trips of it and its
enclosing loops, as `iha_jax.estimate` counts them), that count's share of the program,
and the vector operations its own bundles hold most (`vmatmul`, `vpop` of a unit's
results, `vadd` ...). A bundle is one cycle unless the core stalls, so this is the
anatomy of an ESTIMATE: no TPU ran anything. Loops issuing under `--min_share` of the
program are left out (their bundles still count in their parents' totals).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
  sys.path.insert(0, str(_REPO))

from iha_jax.estimate import llo  # noqa: E402

# A vector operation's mnemonic and, for a result pop, the unit it pops from
# (`%v9 = vpop.f32.mrf.mxu3` -> "vpop.mrf"; `vadd.f32` -> "vadd").
_VECTOR_OP = re.compile(r"(?:=\s*|^\s*|;;\s*)(v[a-z0-9]+)((?:\.[a-z0-9]+)*)")
_POP_UNITS = ("mrf", "eup", "xlane", "trf", "permute")


@dataclasses.dataclass(frozen=True)
class Row:
  """One loop (or the whole program) of the tree."""

  depth: int
  kind: str  # "program" or "loop"
  trips: int | None
  issued: float  # bundles issued in all, children included
  share: float  # of the program's
  ops: tuple[tuple[str, int], ...]  # the own bundles' commonest vector operations


def _op_name(mnemonic: str, suffix: str) -> str:
  if mnemonic == "vpop":
    unit = next((u for u in _POP_UNITS if f".{u}" in suffix), "")
    return f"vpop.{unit}" if unit else mnemonic
  return mnemonic


def profile(text: str, top_ops: int = 6) -> list[Row]:
  """The loop tree of one listing, outermost first (depth-first)."""
  program = llo.parse(text)
  bodies = [body for body, _ in llo.bundles(text)]
  issued: dict[int, float] = {}  # per node (by id): its bundles issued, children included
  for node, times in reversed(program.issues()):  # children before their parents
    issued[id(node)] = times * node.own + sum(issued[id(c)] for c in node.children)
  total = issued[id(program.root)] or 1.0
  rows: list[Row] = []

  def loops_under(node: llo.Node) -> list[llo.Node]:
    """The loops directly under `node`; a predicated span's bundles and loops belong to
    the enclosing loop (a branch may skip them; the estimate counts them)."""
    found = []
    for child in node.children:
      found += [child] if child.kind == "loop" else loops_under(child)
    return found

  def visit(node: llo.Node, depth: int) -> None:
    loops = loops_under(node)
    inside = {i for child in loops for i in range(child.start, child.end + 1)}
    ops: collections.Counter[str] = collections.Counter()
    for position in range(node.start, node.end + 1):
      if position not in inside:
        ops.update(_op_name(m, s) for m, s in _VECTOR_OP.findall(bodies[position]))
    spent = issued[id(node)]
    rows.append(
      Row(depth, node.kind, node.trips, spent, spent / total, tuple(ops.most_common(top_ops)))
    )
    for child in loops:
      visit(child, depth + 1)

  visit(program.root, 0)
  return rows


def table(rows: list[Row], min_share: float = 0.005) -> str:
  lines = [
    "loop tree of libtpu's schedule (bundles issued: an ESTIMATE's anatomy, not a measurement)",
    f"  {'loop':<24} {'trips':>6} {'issued':>13} {'share':>6}  own bundles' commonest ops",
  ]
  for row in rows:
    if row.share < min_share and row.depth:
      continue
    label = "  " * row.depth + row.kind
    trips = "" if row.trips is None else str(row.trips)
    ops = ", ".join(f"{name} {count}" for name, count in row.ops)
    lines.append(f"  {label:<24} {trips:>6} {row.issued:>13,.0f} {row.share:>6.1%}  {ops}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("listing", type=Path, help="a *final_bundles.txt of libtpu's")
  parser.add_argument("--min_share", type=float, default=0.005)
  parser.add_argument("--ops", type=int, default=6, help="operations listed per loop")
  args = parser.parse_args(argv)
  if not args.listing.is_file():
    print(f"schedule_profile: no such listing {args.listing}", file=sys.stderr)
    return 2
  print(table(profile(args.listing.read_text(), args.ops), args.min_share))
  return 0


if __name__ == "__main__":
  sys.exit(main())
