"""Collectives of a compiled TPU program: bytes, the ICI links they cross, estimated time,
and how much of it the schedule hides behind compute (docs/design.md §8, "Collectives").

The model (an estimate: it sets transfer time by link bandwidth alone, no latency, no
contention with HBM):
- The slice is a 3D grid of chips (`device.coords`), one ICI link per direction per
  neighbour pair; an axis wraps around (a ring) when every axis of the slice is a
  multiple of 4 (whole cubes), else it is a line.
- all-gather, reduce-scatter over a group that is a sub-grid of the slice: `(n-1)/n * V /
  W`, V the gathered (or scattered) bytes per chip, W the sum over the group's axes of 2
  links for a whole ring, 1 for a line; all-reduce is a reduce-scatter then an
  all-gather (twice that). A group that is not a sub-grid: one line of W = 1 link.
- collective-permute, all-to-all: every message routed on a shortest path, axis by axis;
  the time is the most loaded directed link's bytes over its bandwidth.
- Overlap: each computation is replayed in its scheduled order, compute ops taking
  their estimated time (`tpu.Estimate`): an asynchronous collective (`*-start` ...
  `*-done`) runs beside the ops between its ends and waits for links an earlier transfer
  still holds; its `*-done` waits for what is left; a synchronous collective waits
  whole. Loops repeat their body's replay.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from iha_jax.estimate import hlo

# v5p: 1200 GB/s of bidirectional ICI bandwidth per chip over its 6 links (3D torus),
# 100 GB/s per link and direction (https://cloud.google.com/tpu/docs/v5p).
LINK_BYTES_PER_S = {"v5p": 100e9}

Link = tuple[tuple[int, ...], int, int]  # (from chip coords, axis, direction +1 / -1)


@dataclasses.dataclass(frozen=True)
class Topology:
  """Chip coordinates of the program's logical devices, and the slice's axes."""

  coords: tuple[tuple[int, ...], ...]  # per logical device id (the device assignment)
  sizes: tuple[int, ...]
  wraps: bool
  link_bytes_per_s: float

  @classmethod
  def of(cls, devices: Sequence[Any], generation: str = "v5p") -> Topology:
    coords = tuple(tuple(int(c) for c in d.coords) for d in devices)
    sizes = tuple(max(c[a] for c in coords) + 1 for a in range(len(coords[0])))
    wraps = all(s % 4 == 0 for s in sizes)
    return cls(coords, sizes, wraps, LINK_BYTES_PER_S[generation])

  def ring(self, axis: int) -> bool:
    return self.wraps and self.sizes[axis] > 2

  def route(self, src: tuple[int, ...], dst: tuple[int, ...]) -> list[Link]:
    """The directed links of a shortest path, axis by axis."""
    links, here = [], list(src)
    for axis, size in enumerate(self.sizes):
      delta = dst[axis] - here[axis]
      if self.ring(axis) and abs(delta) > size // 2:
        delta -= int(math.copysign(size, delta))
      step = 1 if delta > 0 else -1
      for _ in range(abs(delta)):
        links.append((tuple(here), axis, step))
        here[axis] = (here[axis] + step) % size
    return links


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the program: its bytes per chip, its group, estimated time."""

  name: str
  kind: str  # "all-gather", "reduce-scatter", "all-reduce", "collective-permute", ...
  bytes: float  # V: gathered / scattered / reduced / sent bytes per chip
  group: str  # e.g. "64 chips, axes x ring 4, y ring 4, z ring 4"
  seconds: float  # one run, alone on its links
  runs: float = 0.0
  asynchronous: bool = False
  exposed_s: float = 0.0  # all runs: time the schedule waits for it

  @property
  def total_s(self) -> float:
    return self.runs * self.seconds


def collective_time(
  kind: str, volume: float, groups: list[list[int]] | None, pairs, topo: Topology
) -> tuple[float, str, frozenset]:
  """(seconds alone, the group in words, the directed links it holds) of one collective
  of `volume` bytes per chip."""
  if kind in ("collective-permute", "all-to-all"):
    messages = (
      [(s, t, volume) for s, t in pairs]
      if kind == "collective-permute"
      else [(s, t, volume / len(g)) for g in groups or [] for s in g for t in g if s != t]
    )
    load: dict[Link, float] = {}
    hops = 0
    for s, t, size in messages:
      path = topo.route(topo.coords[s], topo.coords[t])
      hops = max(hops, len(path))
      for link in path:
        load[link] = load.get(link, 0.0) + size
    worst = max(load.values(), default=0.0)
    words = f"{len(messages)} messages, up to {hops} hops"
    return worst / topo.link_bytes_per_s, words, frozenset(load)
  group = (groups or [[0]])[0]
  n = len(group)
  if n <= 1:
    return 0.0, "1 chip", frozenset()
  points = [topo.coords[i] for i in group]
  axes = [a for a in range(len(topo.sizes)) if len({p[a] for p in points}) > 1]
  spans = {a: len({p[a] for p in points}) for a in axes}
  if math.prod(spans.values()) == n:  # a sub-grid: every axis at once
    rings = {a: topo.ring(a) and spans[a] == topo.sizes[a] for a in axes}  # whole rings
    links = sum(2 if rings[a] else 1 for a in axes)
    shape = ", ".join(f"{'xyz'[a]} {'ring' if rings[a] else 'line'} {spans[a]}" for a in axes)
  else:
    links, shape = 1, "not a sub-grid: one line"
  factor = 2.0 if kind == "all-reduce" else 1.0
  seconds = factor * (n - 1) / n * volume / (links * topo.link_bytes_per_s)
  held = frozenset(
    link for members in groups or [] for a, b in itertools.pairwise(members)
    for link in topo.route(topo.coords[a], topo.coords[b])
  )  # fmt: skip
  return seconds, f"{n} chips, {shape} ({links} links per chip)", held


@dataclasses.dataclass
class Replay:
  """The schedule replayed: time per run of each computation, collectives found."""

  module: hlo.Module
  op_seconds: dict[str, float]  # compute op name -> estimated seconds per run
  op_runs: dict[str, float]  # compute op name -> runs per step (for loop trip counts)
  topo: Topology
  collectives: dict[str, Collective] = dataclasses.field(default_factory=dict)
  unknown_trips: list[str] = dataclasses.field(default_factory=list)

  def run(self, computation: str, runs: float) -> tuple[float, float]:
    """(wall, compute) seconds of one run of `computation`, run `runs` times a step."""
    clock = compute = 0.0
    shapes = self.module.shapes(computation)
    instructions = self.module.computations[computation]
    done_shapes = {  # an asynchronous start -> its done's result
      i.operands[0]: i.shape for i in instructions if i.opcode.endswith("-done") and i.operands
    }
    pending: dict[str, float] = {}  # an asynchronous collective's start -> its end
    free: dict[Link, float] = {}
    for inst in instructions:
      kind, wrapped = self._collective(inst, shapes)
      if kind is not None:
        done_shape = done_shapes.get(inst.name) if inst.opcode.endswith("start") else None
        in_bytes = sum(hlo.shape_bytes(shapes.get(o, "")) for o in inst.operands)
        volume = hlo.shape_bytes(done_shape or inst.shape) if kind == "all-gather" else in_bytes
        attrs = wrapped.attributes
        groups = hlo.replica_groups(attrs, len(self.topo.coords))
        pairs = hlo.source_target_pairs(attrs)
        seconds, words, links = collective_time(kind, volume, groups, pairs, self.topo)
        begin = max([clock, *(free.get(link, 0.0) for link in links)])
        end = begin + seconds
        free.update(dict.fromkeys(links, end))
        record = Collective(inst.name, kind, volume, words, seconds)
        self._add(record, runs, asynchronous=done_shape is not None)
        if done_shape is not None:
          pending[inst.name] = end
        else:  # it waits whole; a fused one's own compute (its reduction) runs meanwhile
          own = self.op_seconds.get(inst.name, 0.0)
          end = max(end, clock + own)
          self._expose(inst.name, (end - clock - own) * runs)
          clock, compute = end, compute + own
      elif inst.opcode.endswith("-done") and inst.operands and inst.operands[0] in pending:
        start, end = inst.operands[0], pending.pop(inst.operands[0])
        self._expose(start, max(0.0, end - clock) * runs)
        clock = max(clock, end)
      elif inst.opcode == "while":
        called = inst.called()
        trips = self._trips(called["body"], runs)
        wall, inner = self.run(called["body"], runs * trips)
        clock, compute = clock + trips * wall, compute + trips * inner
      elif inst.opcode in ("call", "conditional"):
        targets = inst.branches() or tuple(v for k, v in inst.called().items() if k == "to_apply")
        timed = [self.run(t, runs) for t in targets]
        wall, inner = max(timed, default=(0.0, 0.0))
        clock, compute = clock + wall, compute + inner
      else:
        seconds = self.op_seconds.get(inst.name, 0.0)
        clock, compute = clock + seconds, compute + seconds
    return clock, compute

  def _collective(
    self, inst: hlo.Instruction, shapes: dict[str, str]
  ) -> tuple[str | None, hlo.Instruction]:
    """(the collective's kind, the instruction holding its groups), or (None, inst)."""
    base = inst.opcode.removesuffix("-start")
    if base in hlo.COLLECTIVES:
      return base, inst
    if inst.opcode in ("async-start", "fusion"):  # a collective inside a computation
      for inner in self.module.computations.get(inst.called().get("calls", ""), ()):
        if inner.opcode in hlo.COLLECTIVES:
          # libtpu fuses a reduce-scatter as an all-reduce and a slice of its result,
          # emitted as a reduce-scatter ("all-reduce-scatter"): smaller out than in.
          scatters = hlo.shape_bytes(inst.shape) < sum(
            hlo.shape_bytes(shapes.get(o, "")) for o in inst.operands
          )
          return ("reduce-scatter" if scatters else inner.opcode), inner
    return None, inst

  def _trips(self, body: str, runs: float) -> float:
    """A loop's trips: the runs of an op in its body that libtpu scheduled, over the
    loop's own runs; 1 (the total then a lower bound) when the body has none."""
    for inst in self.module.computations[body]:
      if self.op_runs.get(inst.name, 0.0) > 0 and runs > 0:
        return self.op_runs[inst.name] / runs
    self.unknown_trips.append(body)
    return 1.0

  def _add(self, record: Collective, runs: float, asynchronous: bool) -> None:
    old = self.collectives.get(record.name)
    total = runs + (old.runs if old else 0.0)
    self.collectives[record.name] = dataclasses.replace(
      record, runs=total, asynchronous=asynchronous, exposed_s=old.exposed_s if old else 0.0
    )

  def _expose(self, name: str, seconds: float) -> None:
    old = self.collectives[name]
    self.collectives[name] = dataclasses.replace(old, exposed_s=old.exposed_s + seconds)


@dataclasses.dataclass(frozen=True)
class Communication:
  """A step's collectives, estimated: each one, their total time alone, and the time the
  schedule waits for them (`exposed_s`) beyond its compute (`replayed_compute_s`)."""

  collectives: tuple[Collective, ...]
  total_s: float
  exposed_s: float
  replayed_compute_s: float
  unknown_trips: tuple[str, ...] = ()

  def table(self, top: int = 8) -> list[str]:
    lines = [
      f"  {'collective':<30} {'kind':<18} {'MiB':>8} {'runs':>5} {'est. ms':>8} "
      f"{'exposed':>8}  group (links)"
    ]
    ranked = sorted(self.collectives, key=lambda c: -c.total_s)
    for c in ranked[:top]:
      lines.append(
        f"  {c.name[:30]:<30} {c.kind + (' async' if c.asynchronous else ''):<18} "
        f"{c.bytes / 2**20:>8.2f} {c.runs:>5.0f} {c.total_s * 1e3:>8.3f} "
        f"{c.exposed_s * 1e3:>8.3f}  {c.group}"
      )
    if len(ranked) > top:
      rest = ranked[top:]
      lines.append(
        f"  ({len(rest)} more){'':<48} {sum(c.total_s for c in rest) * 1e3:>8.3f} "
        f"{sum(c.exposed_s for c in rest) * 1e3:>8.3f}"
      )
    return lines


def communication(
  text: str,
  devices: Sequence[Any],
  op_seconds: dict[str, float],
  op_runs: dict[str, float],
  generation: str = "v5p",
) -> Communication:
  """The collectives of a compiled program (`compiled.as_text()`) on `devices` (its device
  assignment, in order), replayed against the compute ops' estimated seconds per run."""
  replay = Replay(hlo.parse(text), op_seconds, op_runs, Topology.of(devices, generation))
  wall, compute = replay.run(replay.module.entry, 1.0)
  found = tuple(replay.collectives.values())
  return Communication(
    found,
    sum(c.total_s for c in found),
    max(0.0, wall - compute),
    compute,
    tuple(replay.unknown_trips),
  )
