"""Each GPU Pallas kernel's innermost loops, counted from the PTX of a deviceless H100 compile.

    python benchmarks/ptx_inner_loop.py                  # the paper's timed shapes, fwd+bwd
    python benchmarks/ptx_inner_loop.py --small          # tiny shapes: a smoke test
    python benchmarks/ptx_inner_loop.py --cases global_mha --json rows.json --ptx_dir ptx/

Static (PTX instruction counts), not a measurement: a loop is a label and a later branch
back to it (`$L__BB0_4: ... @%p3 bra $L__BB0_4;`), its body the statements between them
in the file; innermost = containing no other loop. "main" marks the loop with the most
tensor-core instructions (the most deeply nested on a tie); when that loop holds other
loops it is listed too. Each instruction is counted once, however often it runs. Kernels
are the Triton custom calls of XLA's optimized HLO (no names assumed). Shapes: B = 1,
bf16, forward+backward; windows in virtual tokens, N/(2P) (docs/design.md §2).
Needs `make targets`; e.g. `IHA_TARGETS_DIR=$PWD/.targets python benchmarks/...`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:  # imported when compiling: the parser (and its tests) need no JAX
  import jax

  from benchmarks.kernel_compiles import Case

N, HEADS = 8192, 20  # benchmarks/kernels.py's timed shape (d = 128)
CASES = {  # kernel_compiles.Case fields
  "window_iha": dict(heads=HEADS, num_pseudo=4, window=N // (2 * 4), tokens=N),
  "global_iha": dict(heads=HEADS, num_pseudo=4, tokens=N),
  "global_mha": dict(kind="mha", heads=HEADS, tokens=N),
  "window_iha_p2": dict(heads=HEADS, num_pseudo=2, window=N // (2 * 2), tokens=N),
}
DEFAULT_CASES = "window_iha,global_iha,global_mha"
SMALL = dict(heads=4, head_dim=64, tokens=256)
# Table column -> the JSON keys it shows, joined with "/".
COLUMNS = {"wgmma": ("wgmma",), "wgmma sync": ("wgmma_sync",), "mma.sync": ("mma_sync",)}
COLUMNS |= {"f32 fma/mul/add": ("fma_f32", "mul_f32", "add_f32"), "f16x2/bf16x2": ("packed_f16",)}
COLUMNS |= {
  "ex2": ("ex2",),
  "ld.global": ("ld_global",),
  "ld/st.shared": ("ld_shared", "st_shared"),
}
COLUMNS |= {"cp.async": ("cp_async",), "total": ("total",)}
EXTRA = ("st_global", "atom", "bar")  # JSON only
_F32 = re.compile(r"^(fma|mul|add|sub)(\.[a-z]+)*\.f32$")
_PACKED = re.compile(r"^(fma|mul|add|sub)(\.[a-z]+)*\.b?f16x2$")
_LABEL = re.compile(r"^\s*([$\w]+):\s*(//.*)?$")
_PREFIXES = {"wgmma.": "wgmma_sync", "mma.sync": "mma_sync", "ex2.approx": "ex2"}
_PREFIXES |= {"ld.global": "ld_global", "st.global": "st_global", "ldmatrix": "ld_shared"}
_PREFIXES |= {"ld.shared": "ld_shared", "st.shared": "st_shared", "stmatrix": "st_shared"}
_PREFIXES |= {"atom.": "atom", "red.": "atom", "bar.": "bar", "barrier.": "bar"}


@dataclasses.dataclass(frozen=True)
class Loop:
  """A PTX loop: its header label and the file lines (1-based) of label and back branch."""

  label: str
  start: int
  end: int

  def contains(self, other: Loop) -> bool:
    return self != other and self.start <= other.start and other.end <= self.end


def statements(line: str) -> list[str]:
  """The instructions of one PTX line (inline asm puts several on a line), without labels,
  directives (`.reg`, `.param`), braces and comments."""
  out = []
  for piece in line.split("//")[0].split(";"):
    piece = piece.strip().lstrip("{").rstrip("}").strip()
    if piece and not piece.startswith(".") and not _LABEL.match(piece):
      out.append(piece)
  return out


def opcode(statement: str) -> str:
  """`@%p1 ld.global.b32 {%r1}, [%rd2]` -> `ld.global.b32` (the predicate guard dropped)."""
  tokens = statement.split()
  return tokens[1] if tokens[0].startswith("@") and len(tokens) > 1 else tokens[0]


def category(op: str) -> str | None:
  """The counted category of an opcode, or None (counted in `total` only)."""
  if op.startswith("wgmma.mma_async"):
    return "wgmma"
  if op.startswith("cp.async"):  # the copies; their commit/wait groups count in total only
    return None if re.search(r"commit_group|wait_group|wait_all", op) else "cp_async"
  if _F32.match(op):
    return {"sub": "add"}.get(op.split(".")[0], op.split(".")[0]) + "_f32"
  if _PACKED.match(op):
    return "packed_f16"
  return next((c for p, c in _PREFIXES.items() if op.startswith(p)), None)


def count(lines: list[str]) -> dict[str, int]:
  """Instruction counts by category (zeros included) and `total`, plus tensor-core shapes."""
  counts: collections.Counter = collections.Counter()
  shapes: collections.Counter = collections.Counter()
  for line in lines:
    for statement in statements(line):
      op = opcode(statement)
      counts["total"] += 1
      kind = category(op)
      if kind:
        counts[kind] += 1
      if kind in ("wgmma", "mma_sync"):
        shape = re.search(r"\.(m\d+n\d+k\d+)", op)
        shapes[shape.group(1) if shape else op] += 1
  keys = [key for column in COLUMNS.values() for key in column] + list(EXTRA)
  out = {key: counts[key] for key in keys}
  return out | {"mma_shapes": dict(sorted(shapes.items()))}


def entries(ptx: str) -> dict[str, tuple[int, int]]:
  """Each `.entry` of a PTX file: name -> (first, last) 0-based line of its `{ ... }` body."""
  lines, found = ptx.splitlines(), {}
  starts = [(i, m.group(1)) for i, l in enumerate(lines) if (m := re.search(r"\.entry (\w+)", l))]
  for n, (i, name) in enumerate(starts):
    stop = starts[n + 1][0] if n + 1 < len(starts) else len(lines)
    body = next(j for j in range(i, stop) if lines[j].strip() == "{")
    found[name] = (body + 1, stop - 1)
  return found


def find_loops(lines: list[str], first: int = 0, last: int | None = None) -> list[Loop]:
  """Loops of lines[first..last]: each label branched to from a later line, spanning to the
  last such branch. Line numbers in the result are 1-based."""
  last = len(lines) - 1 if last is None else last
  labels, ends = {}, {}
  for i in range(first, last + 1):
    if match := _LABEL.match(lines[i]):
      labels[match.group(1)] = i
    for statement in statements(lines[i]):
      tokens = statement.split()
      if opcode(statement).startswith("bra") and tokens[-1] in labels:
        ends[tokens[-1]] = i
  loops = (Loop(label, labels[label] + 1, end + 1) for label, end in ends.items())
  return sorted(loops, key=lambda loop: (loop.start, -loop.end))


def loop_rows(name: str, lines: list[str], first: int, last: int) -> list[dict]:
  """Rows for one kernel: its innermost loops, the main loop, and the whole kernel."""
  loops = find_loops(lines, first, last)
  body = {loop: count(lines[loop.start - 1 : loop.end]) for loop in loops}
  tensor = lambda loop: body[loop]["wgmma"] + body[loop]["mma_sync"]
  main = max(loops, key=lambda lp: (tensor(lp), lp.start - lp.end), default=None)
  main = main if main is not None and tensor(main) else None
  rows = []
  for loop in loops:
    nested = sum(loop.contains(other) for other in loops)
    if nested and loop != main:
      continue
    holds = f" (holds {nested} loop{'s' * (nested > 1)})" if nested else ""
    kind = ("main " if loop == main else "inner ") + loop.label + holds
    rows.append({"loop": kind, "lines": f"{loop.start}-{loop.end}"} | body[loop])
  rows.append({"loop": "whole kernel", "lines": f"{first + 1}-{last + 1}"})
  rows[-1] |= count(lines[first : last + 1])
  return [{"kernel": name} | row for row in rows]


def pallas_kernels(dump: Path) -> set[str]:
  """Names of the Pallas (Triton custom-call) kernels in XLA's optimized HLO."""
  names = set()
  for path in dump.glob("*after_optimizations.txt"):
    for line in path.read_text().splitlines():
      if 'custom_call_target="__gpu$xla.gpu.triton"' in line:
        names.update(re.findall(r'\bname = "(\w+)"', line))
  return names


def compile_ptx(case: Case, device: jax.Device, keep: Path | None) -> dict[str, tuple[str, str]]:
  """Compiles `case` for the H100 as `kernel_compiles.compile_case` does, with XLA's dump
  on (`compiled.DUMP_OPTIONS`); returns each Pallas kernel entry's PTX text and the copy
  of its file kept as `keep.<entry>.ptx` ("" if `keep` is None)."""
  # pylint: disable=import-outside-toplevel,protected-access
  import jax

  from benchmarks import kernel_compiles
  from iha_jax.parallel import compiled, targets

  with targets.lowering_for("cuda"):
    lowered = jax.jit(kernel_compiles._function(case, "gpu")).lower(
      *kernel_compiles._inputs(case, device)
    )
  found = {}
  with tempfile.TemporaryDirectory(prefix="iha_ptx_") as dump:
    lowered.compile(compiler_options={"xla_dump_to": dump, **compiled.DUMP_OPTIONS})
    names = pallas_kernels(Path(dump))
    for path in sorted(Path(dump).glob("*.ptx")):
      text = path.read_text()
      for entry in entries(text):
        if compiled.Kernel(entry).kind in names:
          kept = ""
          if keep:
            keep.parent.mkdir(parents=True, exist_ok=True)
            kept = shutil.copy(path, f"{keep}.{entry}.ptx")
          found[entry] = (text, str(kept))
  return found


def case_rows(label: str, case: Case, device: jax.Device, ptx_dir: Path | None) -> list[dict]:
  """Rows of every Pallas kernel of one case; an identical repeat (`iha_forward__1`) is
  folded into its first instance's `copies`."""
  rows, seen = [], {}
  found = compile_ptx(case, device, ptx_dir / label if ptx_dir else None)
  for entry, (text, path) in sorted(found.items()):
    first, last = entries(text)[entry]
    kernel = loop_rows(entry, text.splitlines(), first, last)
    key = repr([{k: v for k, v in r.items() if k != "kernel"} for r in kernel])
    if key in seen:
      for row in seen[key]:
        row["copies"] += 1
      continue
    for row in kernel:
      row.update(case=label, spec=case.label, copies=1, ptx=path)
    seen[key] = kernel
    rows += kernel
  return rows


def table(rows: list[dict]) -> list[str]:
  """Markdown table of `rows` (one case)."""
  lines = ["| kernel | loop | lines | " + " | ".join(COLUMNS) + " | mma shapes |"]
  lines.append("|" + " --- |" * (len(COLUMNS) + 4))
  for row in rows:
    cells = {c: "/".join(str(row[k]) for k in keys) for c, keys in COLUMNS.items()}
    shapes = " ".join(f"{n}x{s}" for s, n in row["mma_shapes"].items())
    copies = f" x{row['copies']}" if row["copies"] > 1 else ""
    cells = [f"{row['kernel']}{copies}", row["loop"], row["lines"], *cells.values(), shapes]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma list of {', '.join(CASES)}")
  parser.add_argument("--small", action="store_true", help="tiny shapes (H=4, d=64, N=256)")
  parser.add_argument("--json", help="write the rows here")
  parser.add_argument("--ptx_dir", type=Path, help="keep each kernel's PTX file here")
  args = parser.parse_args()
  unknown = set(args.cases.split(",")) - set(CASES)
  if unknown:
    parser.error(f"unknown --cases {sorted(unknown)}; known: {', '.join(CASES)}")
  from benchmarks.kernel_compiles import Case  # pylint: disable=import-outside-toplevel
  from iha_jax.parallel import targets  # pylint: disable=import-outside-toplevel

  targets.use_compile_packages("cuda")  # before any other JAX call
  device = targets.devices(targets.parse("h100"))[0]
  print("# Pallas GPU kernels' innermost loops on H100 (sm_90a PTX of a deviceless compile)")
  print("Counts are static (PTX instruction counts), not a measurement: each instruction once,")
  print("however often it runs. f32 add includes sub; ld/st.shared include ldmatrix/stmatrix.\n")
  rows, start, failed = [], time.perf_counter(), False
  for name in args.cases.split(","):
    case = Case(**CASES[name])
    if args.small:
      window = case.window and SMALL["tokens"] // (2 * case.num_pseudo)
      case = dataclasses.replace(case, window=window, **SMALL)
    began = time.perf_counter()
    try:
      found = case_rows(name, case, device, args.ptx_dir)
    except Exception as error:  # a compiler rejection: report it, go on with the next case
      print(f"## {name}: {case.label}: compile failed: {str(error).splitlines()[0][:300]}\n")
      failed = True
      continue
    print(f"## {name}: {case.label} ({time.perf_counter() - began:.0f} s to compile)\n")
    print("\n".join(table(found)) + "\n", flush=True)
    rows += found
  print(f"{len(rows)} rows, {time.perf_counter() - start:.0f} s in all")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
  return int(failed)


if __name__ == "__main__":
  sys.exit(main())
