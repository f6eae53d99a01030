"""libtpu's final VLIW schedule of one compiled program, as a tree of loops and branches.

XLA:TPU writes, per HLO op and per Mosaic kernel, a `*final_bundles.txt` when asked
(`iha_jax.estimate.tpu` sets the flags): one line per VLIW bundle, in address order, e.g.

    0x27 LB: > { %4165 = sst [smem:[...]] %s2877_s20  ;;  ... } /* Start region 131 */
    0x54   : > { %565 = sbr.rel (%p562_p1) target = $region40 }
    0x6b   : > { %p47_p1 = scmp.ge.s32.totalorder %s50_s27, 66 /* loop exit test */ ... }

A TPU core issues one bundle per cycle unless it stalls, so the schedule is most of a
program's time (an *estimate*: DMA waits and stalls are not in it). What this module
reads (format facts of libtpu 0.0.42, checked on XLA ops and Mosaic kernels):
- `sbr.rel (p) target = $regionN` branches to the bundle where region N starts ("Start
  region N" or "Start/End empty region N" in the trailing comment). A forward branch skips
  a *span* (a predicated region: a kernel's `pl.when` body, a pipeline stage); a backward
  branch closes a *loop* whose body starts at region N.
- A loop's trip count is the constant of its exit compare: the one marked
  `/* loop exit test */` (XLA fusions, Mosaic grids and `fori_loop`s; a software-pipelined
  loop runs its steps plus its extra stages), divided by the induction variable's step
  when the loop adds a constant above 1 to it (an unrolled `fori_loop` counts by its
  unroll factor), else the last integer compare against a constant in the body (XLA
  `while` loops).
- `inlined_call ... /* %name = op(...) */` runs another program (the top-level program
  calls each HLO op this way).
- `inlined_call_operand.<memory> [shape: bf16[8192,8192], index: 0, kind: input ...]`
  lists a program's operands and where XLA placed them (hbm, vmem, smem).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from iha_jax.estimate.hlo import ELEMENT_BYTES

_BUNDLE = re.compile(
  r"^\s*(?P<address>0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2})?:?\s*>*\s*\{(?P<body>.*)\}(?P<tail>.*)$"
)
_BRANCH = re.compile(r"sbr\.rel\s*(?:\(!?(%\w+)\))?\s*target = \$region(\d+)")
_REGION_START = re.compile(r"Start(?:/End empty)? region (\d+)")
# (A predicated compare names its predicate first: `totalorder (%p4321_p0), %s1280_s24, 20`.)
_EXIT_TEST = re.compile(
  r"(%\w+) = scmp\.\w+\.s32\.totalorder (?:\(%\w+\),\s*)?(%\w+), (-?\d+) /\* loop exit test \*/"
)
# The induction step of an unrolled loop (`fori_loop(..., unroll=u)` steps by u).
_STEP = r"{register} = sadd\.s32 (\d+), %\w+"
_COMPARE = re.compile(r"scmp\.(lt|ge|le|gt)\.s32\.totalorder %\w+, (-?\d+)")
_CALL = re.compile(r"inlined_call[^/]*/\* (?:%(\S+) = |<([\w-]+)>)")
_OPERAND = re.compile(
  r"inlined_call_operand\.(\w+) \[shape: (\w+)\[([\d,]*)\], index: (\d+), kind: (\w+)"
)


@dataclasses.dataclass(frozen=True)
class Operand:
  """One argument or result of a program, where XLA placed it."""

  memory: str  # "hbm", "vmem", "smem", ...
  dtype: str
  shape: tuple[int, ...]
  kind: str  # "input" or "output"

  @property
  def bytes(self) -> int:
    return math.prod(self.shape) * ELEMENT_BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Node:
  """A loop (`trips` times its body), a span a branch may skip, or the whole program.

  `start`/`end`: bundle positions, inclusive. `own`: bundles not inside a child.
  `calls`: programs called from this node's own bundles, by name."""

  kind: str  # "program", "loop" or "span"
  start: int
  end: int
  trips: int | None = None  # loops: None when no constant compare was found
  own: int = 0
  calls: list[str] = dataclasses.field(default_factory=list)
  children: list[Node] = dataclasses.field(default_factory=list)

  @property
  def size(self) -> int:
    return self.end - self.start + 1

  def walk(self):
    yield self
    for child in self.children:
      yield from child.walk()


@dataclasses.dataclass
class Program:
  """One `final_bundles.txt`: its name (the HLO instruction, or TLP for the top level),
  bundle tree and operands."""

  name: str
  root: Node
  operands: tuple[Operand, ...]

  @property
  def bundles(self) -> int:
    return self.root.size

  @property
  def unknown_trips(self) -> int:
    """Loops whose trip count is computed at run time (counted as one trip each)."""
    return sum(1 for node in self.root.walk() if node.kind == "loop" and node.trips is None)

  def hbm_bytes(self) -> int:
    """Bytes of the operands XLA left in HBM: each read or written at least once."""
    return sum(op.bytes for op in self.operands if op.memory == "hbm")

  def loops(self) -> list[Node]:
    return [node for node in self.root.walk() if node.kind == "loop"]

  def issues(self, span_weight: Callable[[Node], float] | None = None) -> list[tuple[Node, float]]:
    """Every node with how many times its own bundles issue: loops multiply by their
    trips (an unknown trip count as 1), spans by `span_weight(span)` (default 1: the
    branch never skips them)."""
    span_weight = span_weight or (lambda _: 1.0)
    found: list[tuple[Node, float]] = []

    def visit(node: Node, times: float) -> None:
      found.append((node, times))
      for child in node.children:
        scale = (child.trips or 1) if child.kind == "loop" else span_weight(child)
        visit(child, times * scale)

    visit(self.root, 1.0)
    return found

  def cycles(
    self,
    span_weight: Callable[[Node], float] | None = None,
    call_cycles: Callable[[str], float] | None = None,
  ) -> float:
    """Bundles issued (`issues`), plus `call_cycles(name)` for every call made."""
    call_cycles = call_cycles or (lambda _: 0.0)
    return sum(
      times * (node.own + sum(call_cycles(name) for name in node.calls))
      for node, times in self.issues(span_weight)
    )

  def call_counts(self) -> dict[str, float]:
    """How many times each called program runs (loops weighted by their trips)."""
    counts: dict[str, float] = {}
    for node, times in self.issues():
      for name in node.calls:
        counts[name] = counts.get(name, 0.0) + times
    return counts


def bundles(text: str) -> list[tuple[str, str]]:
  """One listing's bundles in address order: (body, trailing comment) each."""
  found = (_BUNDLE.match(line) for line in text.splitlines())
  return [(m.group("body"), m.group("tail")) for m in found if m]


def parse(text: str, name: str = "") -> Program:
  """Parses one final-bundles listing."""
  bodies: list[str] = []
  region_at: dict[int, int] = {}
  for position, (body, tail) in enumerate(bundles(text)):
    bodies.append(body)
    for region in _REGION_START.findall(tail):
      region_at.setdefault(int(region), position)
  operands = tuple(
    Operand(memory, dtype, tuple(int(x) for x in dims.split(",") if x), kind)
    for memory, dtype, dims, _, kind in _OPERAND.findall("\n".join(bodies[:8]))
  )
  nodes: list[Node] = []
  for position, body in enumerate(bodies):
    for predicate, target in _BRANCH.findall(body):
      start = region_at.get(int(target))
      if start is None:
        continue
      if start > position + 1:
        nodes.append(Node("span", _first_busy(bodies, position + 1, start), start - 1))
      elif start <= position:
        trips = _trips(bodies[start : position + 1], predicate)
        nodes.append(Node("loop", start, position, trips=trips))
  root = Node("program", 0, len(bodies) - 1)
  _nest(root, nodes)
  _count_own(root, bodies)
  return Program(name, root, operands)


def read(path: Path) -> Program:
  """`<module id>-<HLO instruction>-<pass number>-final_bundles.txt` -> its program."""
  name = path.name.split("-", 1)[1].rsplit("-", 2)[0]
  return parse(path.read_text(), name)


def _first_busy(bodies: list[str], start: int, stop: int) -> int:
  """The first non-empty bundle at or after `start`: the empty bundles right after a
  branch are its delay slots, which run whether or not it is taken."""
  while start < stop - 1 and not bodies[start].strip():
    start += 1
  return start


def _trips(body: list[str], predicate: str = "") -> int | None:
  """A loop's trips from its body: the exit test that sets the predicate of the loop's
  own backward branch (an inner loop's test may come later in the listing), else the
  last exit test, else an XLA `while`'s compare."""
  tests = [m for line in body for m in _EXIT_TEST.finditer(line)]
  own = [m for m in tests if m.group(1) == predicate]
  if own or tests:
    match = (own or tests)[-1]
    register, bound = match.group(2), int(match.group(3))
    step = re.compile(_STEP.format(register=re.escape(register)))
    steps = [int(m.group(1)) for text in body for m in [step.search(text)] if m]
    return -(-bound // steps[0]) if steps and steps[0] > 1 else bound
  # An XLA `while`: `i < n` (or `i >= n` to exit) on the induction variable.
  for line in reversed(body):
    found = _COMPARE.findall(line)
    if found:
      relation, bound = found[-1]
      trips = int(bound) + (1 if relation in ("le", "gt") else 0)
      return trips if trips > 0 else None
  return None


def _nest(root: Node, nodes: list[Node]) -> None:
  """Builds the containment tree; a construct that straddles another (not nested) is
  dropped (its bundles then count as always issued)."""
  nodes = sorted(nodes, key=lambda n: (n.start, -n.end, n.kind != "loop"))
  stack = [root]
  for node in nodes:
    while node.start > stack[-1].end:
      stack.pop()
    parent = stack[-1]
    if node.end > parent.end or (node.start, node.end) == (parent.start, parent.end):
      continue
    if parent.children and node.start <= parent.children[-1].end:
      continue  # overlaps its previous sibling without being inside it
    parent.children.append(node)
    stack.append(node)


def _count_own(node: Node, bodies: list[str]) -> None:
  inside = np.zeros(node.size, bool)
  for child in node.children:
    inside[child.start - node.start : child.end - node.start + 1] = True
    _count_own(child, bodies)
  node.own = int((~inside).sum())
  for offset in np.flatnonzero(~inside):
    for match in _CALL.finditer(bodies[node.start + offset]):
      if match.group(1):
        node.calls.append(match.group(1))
