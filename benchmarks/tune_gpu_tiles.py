"""Chooses the GPU kernels' launches (`iha_jax.kernels.gpu_tiles.TABLE`) by compiling
candidates for an H100 with XLA's deviceless compiler and ptxas.

    python benchmarks/tune_gpu_tiles.py            # print the table it would choose
    python benchmarks/tune_gpu_tiles.py --write    # and write it into gpu_tiles.py

For every shape key (rows per token Pr in {1, 2, 4, 8}, q/k lanes W in {64, 128}, bf16),
it compiles the forward+backward of a causal window IHA layer (H = 8, N = 4096) with one
candidate launch per kernel, largest tiles first, and keeps for each kernel (forward, dQ,
dK/dV) the first candidate that compiles with zero register spill bytes. Static choice,
not speed: with a GPU, time the survivors (benchmarks/kernels.py) before trusting the
order. Needs `make targets`.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iha_jax.parallel import targets  # noqa: E402

SHAPES = [(pr, width) for pr in (1, 2, 4, 8) for width in (64, 128)]
ROWS = (128, 64, 32)


def candidates():
  """Launch candidates, preferred first: larger tiles, then more warps. Two pipeline
  stages throughout: 1 and 2 gave identical ptxas results for every kernel tried (the
  band loops' gathered loads are not software-pipelined)."""
  from iha_jax.kernels.gpu_tiles import Launch  # pylint: disable=import-outside-toplevel

  grid = itertools.product(ROWS, ROWS, (8, 4))
  key = lambda c: (-c[0] * c[1], -c[0], -c[2])
  return [Launch(*c, num_stages=2) for c in sorted(grid, key=key)]


def tune(pr: int, width: int, dtype: str, device, target, log) -> dict:
  from benchmarks import kernel_compiles  # pylint: disable=import-outside-toplevel
  from iha_jax.kernels import gpu_tiles  # pylint: disable=import-outside-toplevel

  case = kernel_compiles.Case(
    heads=8, pseudo=pr, head_dim=width, tokens=4096, window=1024, dtype=dtype
  )
  names = {"forward": "iha_forward", "dq": "iha_backward_dq", "dkv": "iha_backward_dkv"}
  chosen = {}
  for launch in candidates():
    if launch.rows_q < pr or launch.rows_k < pr:
      continue
    for kernel in gpu_tiles.KERNELS:
      if kernel not in chosen:
        gpu_tiles.TABLE[(kernel, pr, width, dtype)] = launch
    result = kernel_compiles.compile_case(case, target, device)
    stats = result.report.by_kind() if result.ok else {}
    for kernel in gpu_tiles.KERNELS:
      if kernel in chosen:
        continue
      k = stats.get(names[kernel])
      log(
        f"  Pr={pr} W={width} {kernel} {launch}: "
        + (
          f"{k.registers} regs, {k.spill_bytes} B spilled, {k.shared_bytes} B smem, "
          f"{k.tensor_cores}"
          if k
          else f"failed: {result.error}"
        )
      )
      if k and k.spill_bytes == 0:
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
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args()
  target = targets.parse("h100")
  device = targets.devices(target)[0]
  from iha_jax.kernels import gpu_tiles  # pylint: disable=import-outside-toplevel

  gpu_tiles.TABLE.clear()
  for pr, width in SHAPES:
    chosen = tune(pr, width, args.dtype, device, target, lambda line: print(line, flush=True))
    missing = set(gpu_tiles.KERNELS) - set(chosen)
    if missing:
      print(f"Pr={pr} W={width}: no spill-free candidate for {sorted(missing)}", flush=True)
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
