"""Estimated TPU time of a jitted program, from libtpu's final schedule, on a CPU host.

TPUs are statically scheduled VLIW machines: XLA:TPU and Mosaic fix every bundle a core
issues, and a core issues one bundle per cycle unless it waits. So, compiled for a
compile-only TPU (`iha_jax.parallel.targets`), a program's schedule gives an *estimate*
of its time (never a measurement; never print it beside one):
- every HLO op and Mosaic kernel: its bundles, loops times their trip counts
  (`iha_jax.estimate.llo`);
- a Mosaic kernel's `pl.when` bodies weighted by the grid steps that run them, and its
  block copies, both counted from the kernel itself (`iha_jax.estimate.kernel_grid`);
- each op bounded from below by memory: the HBM bytes it must move (its HBM operands,
  or a kernel's block copies) over the chip's HBM bandwidth;
- the top-level program's own bundles, and every op it calls, as many times as it calls
  them (loops over layers included).
Left out: DMA waits and stalls inside an op (bundles undercount MXU-bound code by a few
percent). Collectives (all-reduce, all-gather, ...) are priced apart, by the interconnect
(`iha_jax.estimate.ici`: bytes over the ICI links they cross, and how much of that the
schedule hides behind compute): `Estimate.communication`.

Usage (a fresh process; libtpu must start with the schedule dump switched on):

    from iha_jax.estimate import tpu
    tpu.prepare()            # before anything loads libtpu
    devices = targets.devices(targets.parse("v5p-8"))
    est = tpu.estimate(jax.jit(f), *shape_dtype_structs_on(devices[0]))
    print(est.table())
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from iha_jax.estimate import ici, kernel_grid, llo
from iha_jax.estimate.chips import Chip, EstimateError, chip
from iha_jax.estimate.kernel_cost import kernel_cycles, kernel_mxu_products, kernel_regions

# `hlo_deduplication_all_unique`: by default libtpu compiles identical ops (a scanned
# block's repeated layers, q/k/v projections of one shape) once and writes one schedule
# for all of them, so the top-level program calls names that have no schedule of their
# own; with it every op gets its own program and file (the same code: only compile time
# grows).
_DUMP_FLAGS = (
  "--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true "
  "--xla_jf_dump_llo_pass_label_regex=final_bundles "
  "--xla_jf_hlo_deduplication_all_unique=true"
)
_COLLECTIVES = re.compile(
  r"^(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|send|recv)"
)


@dataclasses.dataclass(frozen=True)
class OpEstimate:
  """One compiled op (an XLA op or a Mosaic kernel) of the program, estimated.

  `runs`: times the program runs it; `bundle_s` / `memory_s`: one run's schedule time
  and HBM floor; `seconds`: their maximum; `weighted`: a kernel's `pl.when` bodies were
  matched to its schedule and weighted by their grid steps (False: counted on every
  step, an upper bound)."""

  name: str
  kind: str  # "kernel", "xla" or "collective" (left out)
  runs: float
  bundle_s: float
  memory_s: float
  weighted: bool = True
  lower_bound: bool = False  # a loop's trip count is only known at run time (counted once)
  regions: tuple[tuple[str, int, float], ...] = ()  # kernels: (region, bundles, runs/core)
  # Kernels: one run's MXU work at peak per product shape (`kernel_mxu_products`).
  mxu_products: tuple[tuple[tuple[int, int, int], float], ...] = ()

  @property
  def mxu_floor_s(self) -> float:
    """A kernel run's MXU work at the chip's peak: no schedule runs it faster."""
    return sum(seconds for _, seconds in self.mxu_products)

  @property
  def seconds(self) -> float:
    return max(self.bundle_s, self.memory_s)

  @property
  def total_s(self) -> float:
    return 0.0 if self.kind == "collective" else self.runs * self.seconds


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A program's estimated time on one chip: `seconds` of compute (ops plus the top-level
  program's own bundles), per op in `ops`; collectives priced apart in `communication`
  (None: one chip, or a chip without an ICI model), of which `exposed_s` adds to the
  step (`total_s`)."""

  chip: Chip
  seconds: float
  ops: tuple[OpEstimate, ...]
  lower_bound: bool = False  # top-level loops of run-time trips counted once: at least this
  # Programs the top level calls that have no schedule file (left out: at least this).
  unscheduled: tuple[str, ...] = ()
  communication: ici.Communication | None = None

  @property
  def exposed_s(self) -> float:
    return self.communication.exposed_s if self.communication else 0.0

  @property
  def total_s(self) -> float:
    """Compute plus the communication the schedule does not hide."""
    return self.seconds + self.exposed_s

  @property
  def collectives(self) -> tuple[str, ...]:
    return tuple(op.name for op in self.ops if op.kind == "collective")

  def kernel_seconds(self) -> float:
    return sum(op.total_s for op in self.ops if op.kind == "kernel")

  def table(self, top: int = 12) -> str:
    """The largest ops, then the total; every figure labelled as an estimate."""
    caveat = f"; uncalibrated: {self.chip.uncalibrated}" if self.chip.uncalibrated else ""
    lines = [
      f"estimated time on one {self.chip.name} chip (libtpu schedule; an estimate, not a "
      f"measurement{caveat})",
      f"  {'op':<44} {'kind':<7} {'runs':>6} {'est. ms each':>12} {'est. ms total':>13}",
    ]
    ranked = sorted(self.ops, key=lambda op: -op.total_s)
    for op in ranked[:top]:
      note = "" if op.weighted else "  (pl.when not matched: every step counted)"
      note += "  (lower bound: run-time loop trips)" if op.lower_bound else ""
      bound = " mem" if op.memory_s > op.bundle_s else ""
      lines.append(
        f"  {op.name[:44]:<44} {op.kind:<7} {op.runs:>6.0f} {op.seconds * 1e3:>12.4f} "
        f"{op.total_s * 1e3:>13.4f}{bound}{note}"
      )
      for region, bundles, runs in op.regions:
        lines.append(f"      {region:<16} {bundles:>7} bundles x {runs:>9.0f} runs per core")
      if op.mxu_floor_s:
        share = 100 * op.mxu_floor_s / op.seconds
        lines.append(
          f"      MXU work at peak {op.mxu_floor_s * 1e3:.4f} ms per run ({share:.0f}% of its "
          "estimate), by product (rows x contraction x columns, ms):"
        )
        lines.append(
          "        "
          + ", ".join(f"{r}x{k}x{c} {t * 1e3:.3f}" for (r, k, c), t in op.mxu_products[:6])
        )
    if len(ranked) > top:
      rest = sum(op.total_s for op in ranked[top:])
      lines.append(
        f"  {f'({len(ranked) - top} more ops)':<44} {'':<7} {'':>6} {'':>12} {rest * 1e3:>13.4f}"
      )
    if self.communication is not None:
      lines += self._communication_lines()
    elif self.collectives:
      lines.append(f"  collectives left out: {', '.join(sorted(set(self.collectives)))}")
    if self.unscheduled:
      lines.append(
        f"  {len(self.unscheduled)} called programs have no schedule (left out): "
        f"{', '.join(self.unscheduled[:8])}{' ...' if len(self.unscheduled) > 8 else ''}"
      )
    at_least = "at least " if self.lower_bound else ""
    if self.communication is None:
      lines.append(f"  estimated total: {at_least}{self.seconds * 1e3:.4f} ms")
    else:
      lines.append(
        f"  estimated total: {at_least}{self.total_s * 1e3:.4f} ms = compute "
        f"{self.seconds * 1e3:.4f} + exposed communication {self.exposed_s * 1e3:.4f}"
      )
    if self.lower_bound:
      lines.append("  (a lower bound: run-time loop trips counted once, or programs left out)")
    return "\n".join(lines)

  def _communication_lines(self) -> list[str]:
    comm = self.communication
    hidden = comm.total_s - comm.exposed_s
    lines = [
      f"  collectives ({len(comm.collectives)}; ICI model, an estimate): {comm.total_s * 1e3:.4f}"
      f" ms alone, {comm.exposed_s * 1e3:.4f} ms exposed ({max(0.0, hidden) * 1e3:.4f} "
      "hidden behind compute by the schedule)",
      *comm.table(),
    ]
    if comm.unknown_trips:
      lines.append(f"  loops of unknown trips counted once: {', '.join(comm.unknown_trips[:4])}")
    return lines


_DUMP_DIR: Path | None = None


def prepare() -> Path:
  """Switches on libtpu's schedule dump for this process (into a fresh temporary
  directory) and returns it. Call before libtpu starts (before `targets.devices`)."""
  global _DUMP_DIR
  if _DUMP_DIR is None:
    _DUMP_DIR = Path(tempfile.mkdtemp(prefix="iha_tpu_schedule_"))
    flags = _DUMP_FLAGS.format(dir=_DUMP_DIR)
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flags}".strip()
  return _DUMP_DIR


def estimate(
  jitted: Any, *args: Any, target: str = "v5p", keep_schedule: Path | None = None
) -> Estimate:
  """Compiles `jitted` (a `jax.jit` function) for `args` (ShapeDtypeStructs placed on
  compile-only devices of `target`'s generation) and estimates one run on one chip.
  `keep_schedule`: a directory to copy libtpu's schedule files into (else deleted)."""
  return estimate_traced(jitted.trace(*args), target=target, keep_schedule=keep_schedule)[1]


def estimate_traced(
  traced: Any,
  *,
  target: str = "v5p",
  compile_fn: Callable[[Any], tuple[Any, Any]] | None = None,
  keep_schedule: Path | None = None,
) -> tuple[tuple[Any, Any], Estimate]:
  """`estimate` of a traced program (`jax.jit(f).trace(...)`), compiled by
  `compile_fn(lowered) -> (executable, extra)` (default `(lowered.compile(), None)`);
  returns (that pair, the estimate), so a caller that compiles anyway (a memory report)
  compiles once."""
  dump = prepare()
  spec = chip(target)
  if keep_schedule is None and os.environ.get("IHA_TPU_SCHEDULE_DIR"):
    keep_schedule = Path(os.environ["IHA_TPU_SCHEDULE_DIR"])  # read the schedule yourself
  calls = kernel_grid.kernel_calls_in(traced.jaxpr, cores=spec.cores)
  before = set(dump.iterdir())
  result = (compile_fn or (lambda lowered: (lowered.compile(), None)))(traced.lower())
  new_files = [p for p in dump.iterdir() if p not in before]
  written = [p for p in new_files if p.name.endswith("final_bundles.txt")]
  if not written:
    raise EstimateError(
      "libtpu wrote no schedule: call iha_jax.estimate.tpu.prepare() before "
      "libtpu starts (before targets.devices), in a fresh process"
    )
  if keep_schedule is not None:
    keep_schedule.mkdir(parents=True, exist_ok=True)
    for path in new_files:  # the schedules, the scheduled HLO and VMEM reports
      if path.is_file():
        shutil.copy(path, keep_schedule / path.name)
  try:
    estimated = _estimate(written, calls, spec)
    return result, dataclasses.replace(
      estimated, communication=_communication(result[0], estimated)
    )
  finally:
    for path in new_files:
      shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _estimate(paths: list[Path], calls: list[kernel_grid.KernelCall], spec: Chip) -> Estimate:
  programs = {}
  top = None
  for path in paths:
    if "-01-final_bundles" not in path.name and "final_bundles" not in path.name:
      continue
    if "schedule-analysis" in path.name:
      continue
    program = llo.read(path)
    if program.name == "TLP":
      top = program
    elif not program.name.startswith("<"):
      programs[program.name] = program
  if top is None:
    raise EstimateError("libtpu's schedule has no top-level program (TLP)")
  ops: dict[str, OpEstimate] = {}
  for name, program in programs.items():
    ops[name] = _op(name, program, calls, spec)
  counts = top.call_counts()
  ops = {
    name: dataclasses.replace(op, runs=counts.get(name, 0.0))
    for name, op in ops.items()
    if counts.get(name, 0.0) > 0
  }
  unscheduled = tuple(
    sorted(name for name in counts if name not in programs and not name.startswith("<"))
  )
  cycles = top.cycles(call_cycles=lambda name: 0.0)
  seconds = cycles / spec.clock_hz + sum(op.total_s for op in ops.values())
  # A top-level loop of run-time trips (an XLA `while` whose bound is computed on the
  # chip) that calls ops repeats them: the total is then a lower bound. Inside one op such
  # loops are copies' remainders, bounded by the op's memory floor: flagged on the op only.
  lower = any(
    node.kind == "loop" and node.trips is None and any(n.calls for n in node.walk())
    for node in top.root.walk()
  )
  lower = lower or bool(unscheduled)
  return Estimate(spec, seconds, tuple(ops.values()), lower_bound=lower, unscheduled=unscheduled)


def _communication(executable: Any, estimated: Estimate) -> ici.Communication | None:
  """The compiled program's collectives on its devices (None: one device, or no ICI
  model of this chip)."""
  shardings = [s for s in jax.tree.leaves(executable.input_shardings) if hasattr(s, "mesh")]
  if estimated.chip.name not in ici.LINK_BYTES_PER_S or not shardings:
    return None
  devices = list(shardings[0].mesh.devices.flat)
  if len(devices) < 2:
    return None
  compute = [op for op in estimated.ops if op.kind != "collective"]
  return ici.communication(
    executable.as_text(),
    devices,
    {op.name: op.seconds for op in compute},
    {op.name: op.runs for op in compute},
    estimated.chip.name,
  )


def _op(name: str, program: llo.Program, calls: list, spec: Chip) -> OpEstimate:
  if _COLLECTIVES.match(name):
    return OpEstimate(name, "collective", 0.0, 0.0, 0.0)
  call = _matching_call(name, program, calls)
  if call is None:
    return OpEstimate(
      name,
      "xla",
      0.0,
      program.cycles() / spec.clock_hz,
      _xla_bytes(name, program) / spec.hbm_bytes_per_s,
      lower_bound=program.unknown_trips > 0,
    )
  cycles, weighted = kernel_cycles(program, call, spec)
  return OpEstimate(
    name,
    "kernel",
    0.0,
    cycles / spec.clock_hz,
    call.dma_bytes / spec.hbm_bytes_per_s,
    weighted and call.weighted,
    lower_bound=program.unknown_trips > 0,
    regions=kernel_regions(program, call),
    mxu_products=kernel_mxu_products(call, spec),
  )


def _xla_bytes(name: str, program: llo.Program) -> float:
  """The HBM bytes an XLA op must move: its HBM operands, each at least once, except a
  buffer a dynamic-update-slice updates in place (an input and the output of one shape,
  e.g. a table filled one slice per loop trip): that op moves its slice, which its
  bundles (the slice's DMA and its computation) already bound."""
  operands = [op for op in program.operands if op.memory == "hbm"]
  if "dynamic-update-slice" in name:
    outputs = {(op.dtype, op.shape) for op in operands if op.kind == "output"}
    aliased = {
      key
      for key in outputs
      if any(op.kind == "input" and (op.dtype, op.shape) == key for op in operands)
    }
    operands = [op for op in operands if (op.dtype, op.shape) not in aliased]
  return float(sum(op.bytes for op in operands))


def _matching_call(name: str, program: llo.Program, calls: list):
  base = re.sub(r"\.\d+$", "", name)
  # XLA may list a kernel's operands in another order than the call: compare as sets.
  shapes = sorted(op.shape for op in program.operands if op.kind == "input")
  # A kernel under a custom VJP is named for its transformations too
  # (`transpose_jvp_<name>__`): the call's name inside it.
  named = [c for c in calls if c.name == base] or [c for c in calls if c.name and c.name in base]
  found = [c for c in named if sorted(c.input_shapes) == shapes]
  return (found or named or [None])[0]
