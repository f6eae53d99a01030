"""Chooses the GPU kernels' launches (`iha_jax.kernels.gpu_tiles.TABLE`) by compiling
candidates for an H100 with XLA's deviceless compiler and ptxas.

    python benchmarks/tune_gpu_tiles.py            # print the table it would choose
    python benchmarks/tune_gpu_tiles.py --write    # and write it into gpu_tiles.py

    python benchmarks/tune_gpu_tiles.py --write --shapes 2x128 16x128   # some keys only

For every shape key (rows per token Pr, lanes W = the widest of q/k and v, dtype; `SHAPES`)
it compiles the forward+backward of an IHA layer (P = Pr and H = 8, or P = H = 20 for
Pr = 32; N = 4096, d = W) in two mask variants, causal with a window and bidirectional
with segment ids (their kernels differ in registers), with one candidate launch per
kernel, largest tiles first, and keeps for each kernel (forward, dQ, dK/dV) the first
candidate with zero register spill bytes in both.
Static choice, not speed: with a GPU, time the survivors (benchmarks/kernels.py) before
trusting the order. Needs `make targets`.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iha_jax.parallel import targets  # noqa: E402

# (Pr, W, dtype): the default shapes, P in {1, 2, 4, 8} (Pr = P) at d in {64, 128}; W = 256
# (d = 256, and differential attention's dv = 2d = 256) at P = 1 and 4; P up to 32 (the
# paper's P = H = 20: Pr = 32).
SHAPES = [(pr, width, "bfloat16") for pr in (1, 2, 4, 8) for width in (64, 128)] + [
  (1, 256, "bfloat16"),
  (4, 256, "bfloat16"),
  (16, 128, "bfloat16"),
  (32, 128, "bfloat16"),
]
ROWS = (128, 64, 32, 16)


def candidates():
  """Launch candidates, preferred first: tiles of at least 32 rows each way, larger
  first, then more warps; 16-row tiles (small matmuls) only after those. Two pipeline
  stages throughout: 1 and 2 gave identical ptxas results for every kernel tried (the
  band loops' gathered loads are not software-pipelined)."""
  from iha_jax.kernels.gpu_tiles import Launch  # pylint: disable=import-outside-toplevel

  grid = itertools.product(ROWS, ROWS, (8, 4))
  key = lambda c: (min(c[0], c[1]) < 32, -c[0] * c[1], -c[0], -c[2])
  return [Launch(*c, num_stages=2) for c in sorted(grid, key=key)]


def tune(pr: int, width: int, dtype: str, device, target, log) -> dict:
  from benchmarks import kernel_compiles  # pylint: disable=import-outside-toplevel
  from iha_jax.kernels import gpu_tiles  # pylint: disable=import-outside-toplevel

  # H = 8, except the paper's P = H = 20 for Pr = 32 (the head count changes the mixing
  # loops' registers: a launch clean at H = 8 spilled 8 bytes at H = 20).
  heads, pseudo = (20, 20) if pr == 32 else (8, pr)
  shape = dict(heads=heads, pseudo=pseudo, head_dim=width, tokens=4096, dtype=dtype)
  variants = (
    kernel_compiles.Case(**shape, window=1024),
    kernel_compiles.Case(**shape, causal=False, segments=True),
  )
  names = {"forward": "iha_forward", "dq": "iha_backward_dq", "dkv": "iha_backward_dkv"}
  chosen = {}
  for launch in candidates():
    if launch.rows_q < pr or launch.rows_k < pr:
      continue
    for kernel in gpu_tiles.KERNELS:
      if kernel not in chosen:
        gpu_tiles.TABLE[(kernel, pr, width, dtype)] = launch
    # The second variant only when the first left some kernel spill-free (half the compiles).
    results = [kernel_compiles.compile_case(variants[0], target, device)]
    stats = [results[0].report.by_kind() if results[0].ok else {}]
    open_kernels = [kernel for kernel in gpu_tiles.KERNELS if kernel not in chosen]
    if any((k := stats[0].get(names[kernel])) and k.spill_bytes == 0 for kernel in open_kernels):
      results.append(kernel_compiles.compile_case(variants[1], target, device))
      stats.append(results[1].report.by_kind() if results[1].ok else {})
    for kernel in open_kernels:
      found = [s.get(names[kernel]) for s in stats]
      errors = "; ".join(r.error for r in results if not r.ok)
      log(
        f"  Pr={pr} W={width} {dtype} {kernel} {launch}: "
        + (
          " | ".join(
            f"{k.registers} regs, {k.spill_bytes} B spilled, {k.shared_bytes} B smem, "
            f"{k.tensor_cores}"
            for k in found
          )
          if all(found)
          else f"failed: {errors or 'no such kernel'}"
        )
      )
      if len(found) == len(variants) and all(k and k.spill_bytes == 0 for k in found):
        chosen[kernel] = launch
    if len(chosen) == len(gpu_tiles.KERNELS):
      break
  for kernel in gpu_tiles.KERNELS:  # keep the table exact: drop what was left unsettled
    gpu_tiles.TABLE.pop((kernel, pr, width, dtype), None)
    if kernel in chosen:
      gpu_tiles.TABLE[(kernel, pr, width, dtype)] = chosen[kernel]
  return chosen


def render(table: dict) -> str:
  lines = ["TABLE: dict[tuple[str, int, int, str], Launch] = {"]
  for (kernel, pr, width, dtype), l in sorted(table.items()):
    launch = f"Launch({l.rows_q}, {l.rows_k}, {l.num_warps}, {l.num_stages})"
    lines.append(f'  ("{kernel}", {pr}, {width}, "{dtype}"): {launch},')
  lines.append("}")
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--write", action="store_true", help="rewrite gpu_tiles.TABLE")
  parser.add_argument(
    "--shapes", nargs="*", help="PrxW[xdtype] keys to re-tune (default: all of SHAPES)"
  )
  args = parser.parse_args()
  shapes = SHAPES
  if args.shapes:
    shapes = []
    for text in args.shapes:
      pr, width, *dtype = text.split("x")
      shapes.append((int(pr), int(width), dtype[0] if dtype else "bfloat16"))
  targets.use_compile_packages("cuda")
  target = targets.parse("h100")
  device = targets.devices(target)[0]
  from iha_jax.kernels import gpu_tiles  # pylint: disable=import-outside-toplevel

  for pr, width, dtype in shapes:
    chosen = tune(pr, width, dtype, device, target, lambda line: print(line, flush=True))
    missing = set(gpu_tiles.KERNELS) - set(chosen)
    if missing:
      print(f"Pr={pr} W={width} {dtype}: no spill-free launch for {sorted(missing)}", flush=True)
  text = render(gpu_tiles.TABLE)
  print(text)
  if args.write:
    path = Path(gpu_tiles.__file__)
    source = path.read_text()
    # The table literal: `{}` when empty, else one entry per line and a closing `}`.
    table = re.compile(r"TABLE: dict\[[^\n]*?\] = \{(\}|\n.*?\n\})", re.S)
    if not table.search(source):
      raise SystemExit(f"no TABLE literal found in {path}")
    source = table.sub(lambda _: text, source, count=1)
    path.write_text(source)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
