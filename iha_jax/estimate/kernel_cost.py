"""A Mosaic kernel's cost in libtpu's schedule: its grid loop's bundles, each `pl.when`
body weighted by the grid steps that run it (`iha_jax.estimate.kernel_grid`), every region
no faster than its MXU work at the chip's peak."""

from __future__ import annotations

import collections

from iha_jax.estimate import kernel_grid, llo
from iha_jax.estimate.chips import Chip


def kernel_cycles(
  program: llo.Program, call: kernel_grid.KernelCall, spec: Chip | None = None
) -> tuple[float, bool]:
  """The slowest core's cycles of one kernel run: its grid loop's bundles, with each
  `pl.when` body (matched in source order to the branches the loop body holds) weighted
  by the share of the core's steps that run it; with `spec`, each region (the bundles
  outside every `pl.when`, and each top-level `pl.when` body with what nests in it) no
  faster than its MXU work at the chip's peak (bundles count an MXU pass's instruction,
  not the cycles it holds the MXU). Returns (cycles, matched)."""
  loops = [n for n in program.root.children if n.kind == "loop"]
  grid_loop = max(loops, key=lambda n: n.size * (n.trips or 1), default=program.root)
  worst, matched = 0.0, True
  for core, steps in enumerate(call.core_steps):
    weights: dict[int, float] = {}
    ok = _match(grid_loop.children, call.whens, steps, core, weights, top=grid_loop)
    matched &= ok
    cycles = program.cycles(span_weight=lambda node, w=weights: w.get(id(node), 1.0))
    if spec is not None:
      cycles += _mxu_shortfall(grid_loop, call, core, steps, weights, cycles, spec)
    worst = max(worst, cycles)
  return worst, matched


def _mxu_shortfall(grid_loop, call, core: int, steps: int, weights, cycles: float, spec: Chip):
  """Cycles to add so that every region takes at least its MXU work at peak."""
  rate = spec.flops_per_core_cycle
  found = [n for n in grid_loop.walk() if id(n) in weights]
  matched = [n for n in found if _outermost(n, found)]
  shortfall, bodies = 0.0, 0.0
  for node, when in zip(matched, call.whens):
    body = weights[id(node)] * steps * program_cycles(node, weights)
    bodies += body
    floor = _when_flops(when, core, spec.mxu_edge) / rate
    shortfall += max(0.0, floor - body)
  outside = cycles - bodies
  floor = steps * call.mxu_work.flops(spec.mxu_edge) / rate
  return shortfall + max(0.0, floor - outside)


def _when_flops(when: kernel_grid.When, core: int, edge: int) -> float:
  return sum(_when_products(when, core, edge).values())


def _when_products(when: kernel_grid.When, core: int, edge: int) -> collections.Counter:
  """FLOPs per product shape of a `pl.when` body and what nests in it, over `core`'s steps."""
  own = when.mxu_work.flops_by_product(edge) if when.mxu_work is not None else {}
  out = collections.Counter({shape: when.steps[core] * f for shape, f in own.items()})
  for child in when.children:
    out.update(_when_products(child, core, edge))
  return out


def kernel_mxu_products(
  call: kernel_grid.KernelCall, spec: Chip
) -> tuple[tuple[tuple[int, int, int], float], ...]:
  """One kernel run's MXU work at the chip's peak per product shape (rows, contraction,
  columns as issued; seconds, largest first) on the core with the most: the floor that
  `kernel_cycles` holds each region to, summed."""
  rate = spec.flops_per_core_cycle * spec.clock_hz
  own = call.mxu_work.flops_by_product(spec.mxu_edge)
  most = collections.Counter()
  for core, steps in enumerate(call.core_steps):
    flops = collections.Counter({shape: steps * f for shape, f in own.items()})
    for when in call.whens:
      flops.update(_when_products(when, core, spec.mxu_edge))
    if flops.total() > most.total():
      most = flops
  return tuple((shape, f / rate) for shape, f in most.most_common())


def kernel_regions(program: llo.Program, call: kernel_grid.KernelCall):
  """(region, bundles per run, runs on the busiest core) of a kernel: its grid loop's
  unconditional bundles, then each matched `pl.when` body (bundles including what nests
  in it), for reading where a kernel's time goes."""
  loops = [n for n in program.root.children if n.kind == "loop"]
  grid_loop = max(loops, key=lambda n: n.size * (n.trips or 1), default=program.root)
  core = max(range(len(call.core_steps)), key=lambda c: call.core_steps[c])
  weights: dict[int, float] = {}
  if not _match(
    grid_loop.children, call.whens, call.core_steps[core], core, weights, top=grid_loop
  ):
    return ()
  body = lambda node: program_cycles(node, weights)
  matched = [n for n in grid_loop.walk() if id(n) in weights]
  always = body(grid_loop) - sum(
    weights[id(n)] * body(n) for n in matched if _outermost(n, matched)
  )
  steps = call.core_steps[core]
  rows = [("every step", round(always), float(grid_loop.trips or 1))]
  for index, node in enumerate(n for n in matched):
    rows.append((f"pl.when #{index + 1}", round(body(node)), weights[id(node)] * steps))
  return tuple(rows)


def _outermost(node, matched) -> bool:
  return not any(
    other is not node and other.start <= node.start and node.end <= other.end for other in matched
  )


def program_cycles(node: llo.Node, weights: dict[int, float]) -> float:
  """Bundles issued by one run of `node` (nested loops by trips, matched spans weighted)."""
  total = float(node.own)
  for child in node.children:
    scale = (child.trips or 1) if child.kind == "loop" else weights.get(id(child), 1.0)
    total += scale * program_cycles(child, weights)
  return total


def _match(nodes, whens, parent_steps: int, core: int, weights: dict[int, float], top=None) -> bool:
  spans = [n for n in nodes if n.kind == "span"]
  # A software-pipelined grid wraps the kernel body in a predicated stage spanning most of
  # the loop body (beside smaller branches of the pipeline's copies): look inside it.
  while top is not None and len(spans) != len(whens):
    stage = [n for n in spans if n.size * 2 >= top.size]
    if len(stage) != 1:
      break
    spans = [n for n in stage[0].children if n.kind == "span"]
  if len(spans) != len(whens):
    return not whens
  ok = True
  for node, when in zip(spans, whens):
    steps = when.steps[core]
    weights[id(node)] = steps / max(parent_steps, 1)
    ok &= _match(node.children, when.children, steps, core, weights)
  return ok
