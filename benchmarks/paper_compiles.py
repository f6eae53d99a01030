"""The paper's 2.4B runs compiled for a v5p-128 slice and for 8 H100s, from this CPU host.

    python benchmarks/paper_compiles.py [--targets v5p-128,h100x8] [--out FILE]

Runs `train.py --compile_only` (the real train step: scan over 26 layers, the config's
remat, AdamW, FSDP over every chip) for the 2.4B IHA model as shipped (P = H = 20), at
P = 4, with grouped-query attention (configs/iha_gqa_2p4b.py), and its four baselines,
and prints one markdown row per (config, target): compile status and the per-device
memory XLA assigned. Global batch 128 x 8192 tokens, as the
paper: 2 sequences per chip on v5p-128; on 8 H100s 16 per GPU, run as
`grad_accum_steps = 8` microbatches of 2. Compiled, not run: memory, never speed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [
  ("IHA `LLLLM`, P = H = 20 (as shipped)", "configs/iha_2p4b.py", []),
  ("IHA `LLLLM`, P = 4", "configs/iha_2p4b.py", ["--config.model.num_pseudo=4"]),
  ("IHA `LLLLM`, P = H = 20, GQA G = 5", "configs/iha_gqa_2p4b.py", []),
  ("global MHA `M`", "configs/global_2p4b.py", []),
  ("Global+Local `SSSSM`", "configs/global_local_2p4b.py", []),
  ("Talking-Heads `T`", "configs/talking_heads_2p4b.py", []),
  ("differential `D`", "configs/diff_2p4b.py", []),
]
PER_TARGET = {"h100x8": ["--config.train.grad_accum_steps=8"]}
_MEMORY = re.compile(r"temporaries ([\d.]+ \w+); total ([\d.]+ \w+) of ([\d.]+) GiB HBM \((\d+)%\)")


def compile_run(config: str, overrides: list[str], target: str) -> tuple[bool, str, str, float]:
  """(ok, temporaries, total / HBM, seconds) of one `train.py --compile_only`."""
  start = time.perf_counter()
  proc = subprocess.run(
    [
      sys.executable,
      "train.py",
      f"--config={config}",
      "--compile_only",
      f"--target={target}",
      "--config.model.vocab_size=128256",
      *overrides,
      *PER_TARGET.get(target, []),
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  seconds = time.perf_counter() - start
  memory = _MEMORY.search(proc.stdout)
  if proc.returncode or not memory:
    error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    total = f"{memory.group(2)} of {memory.group(3)} GiB" if memory else ""
    return False, error[:300], total, seconds
  temp, total, hbm, share = memory.groups()
  return True, temp, f"{total} of {hbm} GiB ({share}%)", seconds


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--targets", default="v5p-128,h100x8")
  parser.add_argument("--out", help="also write the table here")
  args = parser.parse_args()
  lines = [
    "| run | target | compiles | temporaries | per-device total | compile s |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  ok = True
  for target in args.targets.split(","):
    for name, config, overrides in RUNS:
      fits, temp, total, seconds = compile_run(config, overrides, target)
      ok &= fits
      status = "yes" if fits else f"**no**: {temp}"
      lines.append(
        f"| {name} | {target} | {status} | {temp if fits else ''} | {total} | {seconds:.0f} |"
      )
      print(lines[-1], flush=True)
  table = "\n".join(lines)
  print("\n" + table)
  if args.out:
    Path(args.out).write_text(table + "\n")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
