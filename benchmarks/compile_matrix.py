"""The Pallas kernels compiled by TPU's and H100's own compilers, at the shapes layers make.

    python benchmarks/compile_matrix.py                       # every case, TPU and H100
    python benchmarks/compile_matrix.py --out docs/compile_matrix.md
    python benchmarks/compile_matrix.py --platform tpu --cases smoke --json
    python benchmarks/compile_matrix.py --platform cuda --out docs/compile_matrix.md
        # one platform: rewrites that platform's section of the page, keeps the other's
    python benchmarks/compile_matrix.py --cases gqa --out docs/compile_matrix.md
        # grouped-query cases only: rewrites their rows of the page, keeps the others

A covering set of kernel configurations (`CASES`: every value of every axis appears, and
every combination a shipped config produces), forward+backward unless marked, each
compiled on one compile-only chip of TPU v5e, v5p and v6e (XLA:TPU + Mosaic) and of an
H100 (XLA:GPU + Triton + ptxas 12.9). Per case: compile status, each kernel's scoped VMEM
(TPU) or registers, spill stores, shared memory and tensor-core instructions (H100), and
the program's compiled temporaries. Compiled, not run: static resources, never speed.
Each platform compiles in its own process (its compiler packages: `make targets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_compiles import Case  # noqa: E402

TPU_TARGETS = ("v5e-4", "v5p-8", "v6e-4")
GPU_TARGETS = ("h100",)
KERNELS = ("iha_flash_forward", "iha_flash_dq", "iha_flash_dkv")

# (name, case). 2.4B: H = 20, d = 128, N = 8192 (configs/iha_2p4b.py and its baselines).
CASES = [
  ("2.4B L layer as shipped (P = H = 20)", Case(heads=20, num_pseudo=20, window=204, tokens=8192)),
  ("2.4B L layer at P = 4", Case(heads=20, num_pseudo=4, window=1024, tokens=8192)),
  (
    "2.4B L layer as shipped, on-chip (P = H = 20)",
    Case(heads=20, num_pseudo=20, window=204, tokens=8192, onchip=True),
  ),
  (
    "2.4B L layer at P = 4, on-chip",
    Case(heads=20, num_pseudo=4, window=1024, tokens=8192, onchip=True),
  ),
  (
    "350M L layer, on-chip (H = 16, d = 64, P = 4)",
    Case(heads=16, head_dim=64, num_pseudo=4, window=512, tokens=4096, onchip=True),
  ),
  (
    "64k stage L layer, on-chip: one of 4 sequence shards (P = H = 20)",
    Case(heads=20, num_pseudo=20, window=1638, tokens=65536, shards=4, onchip=True),
  ),
  ("2.4B global IHA, P = H = 20", Case(heads=20, num_pseudo=20, tokens=8192)),
  ("2.4B M layer (global MHA)", Case(kind="mha", heads=20, tokens=8192)),
  ("2.4B S layer (window 512 MHA)", Case(kind="mha", heads=20, tokens=8192, window=512)),
  ("2.4B D layer (diff: MHA, dv = 2d)", Case(kind="mha", heads=20, value_dim=256, tokens=8192)),
  ("P = 1", Case(num_pseudo=1, window=2048)),
  ("P = 2", Case(num_pseudo=2, window=1024)),
  ("P = 4", Case(num_pseudo=4, window=512)),
  ("P = 8", Case(num_pseudo=8, window=256)),
  ("P = 2, d = 64", Case(num_pseudo=2, head_dim=64, window=1024)),
  ("P = 4, d = 64", Case(num_pseudo=4, head_dim=64, window=512)),
  ("P = 8, d = 64", Case(num_pseudo=8, head_dim=64)),
  ("P = 4, d = 256", Case(num_pseudo=4, head_dim=256, window=512)),
  ("P = H = 32", Case(heads=32, num_pseudo=32, tokens=2048)),
  ("P = 2, bidirectional, segments", Case(num_pseudo=2, causal=False, segments=True)),
  (
    "P = 4, bidirectional window, segments",
    Case(num_pseudo=4, causal=False, window=512, segments=True),
  ),
  (
    "P = 4, per-head collapse, segments",
    Case(num_pseudo=4, window=512, segments=True, collapse="per_head"),
  ),
  ("P = 2, float32", Case(num_pseudo=2, window=1024, dtype="float32")),
  ("P = 4, d = 64, float32", Case(num_pseudo=4, head_dim=64, dtype="float32")),
  ("MHA, float32, bidirectional", Case(kind="mha", causal=False, dtype="float32")),
  ("MHA, d = 64", Case(kind="mha", head_dim=64, window=1024)),
  ("P = 4, forward only", Case(num_pseudo=4, window=512, backward=False)),
  ("long context: P = 4, N = 65536, window 8192", Case(num_pseudo=4, tokens=65536, window=8192)),
  ("long context: MHA, N = 65536", Case(kind="mha", tokens=65536)),
  (
    "demo (configs/default.py): P = 2, H = 4, d = 16",
    Case(heads=4, num_pseudo=2, head_dim=16, tokens=64, window=16, dtype="float32"),
  ),
]

# Grouped-query attention (G key/value heads for H query heads): configs/iha_gqa_2p4b.py's
# layers, Llama 3 8B's attention shapes (H = 32, G = 8, d = 128) and multi-query (G = 1).
GQA_CASES = [
  (
    "GQA: 2.4B L layer (P = H = 20, G = 5)",
    Case(heads=20, kv_heads=5, num_pseudo=20, window=204, tokens=8192),
  ),
  ("GQA: 2.4B M layer (MHA, G = 5)", Case(kind="mha", heads=20, kv_heads=5, tokens=8192)),
  (
    "GQA: Llama 3 8B shapes, IHA P = 4",
    Case(heads=32, kv_heads=8, num_pseudo=4, window=1024, tokens=8192),
  ),
  ("GQA: Llama 3 8B shapes, MHA", Case(kind="mha", heads=32, kv_heads=8, tokens=8192)),
  ("MQA: P = 2, G = 1", Case(num_pseudo=2, kv_heads=1, window=1024)),
  (
    "MQA: MHA, G = 1, bidirectional, segments",
    Case(kind="mha", kv_heads=1, causal=False, segments=True),
  ),
]
CASES += GQA_CASES


def _case(label: str) -> Case:
  return dict(CASES)[label]


# The suite's fast subset (tests/kernels/test_compile_targets.py): the paper's P = H = 20 backward
# on v5p, default H100 shapes, one sequence shard per platform (context parallelism: a
# traced query offset), and controls the compilers must flag (names "control: ...").
SMOKE = {
  "tpu": [
    ("2.4B L layer as shipped (P = H = 20)", dataclasses.replace(CASES[0][1], tokens=2048)),
    (
      "GQA: 2.4B L layer (P = H = 20, G = 5), one of 4 sequence shards",
      dataclasses.replace(GQA_CASES[0][1], tokens=2048, shards=4),
    ),
    ("2.4B D layer (diff: MHA, dv = 2d)", _case("2.4B D layer (diff: MHA, dv = 2d)")),
    (
      "on-chip: 2.4B L layer (P = H = 20)",
      Case(heads=20, num_pseudo=20, window=204, tokens=2048, onchip=True),
    ),
    (
      "on-chip GQA: 2.4B L layer (G = 5), one of 4 sequence shards",
      Case(heads=20, kv_heads=5, num_pseudo=20, window=204, tokens=2048, shards=4, onchip=True),
    ),
    (
      "control: 2048-row tiles at P = 4, forward",
      Case(num_pseudo=4, tokens=2048, window=512, blocks=(2048, 2048), backward=False),
    ),
  ],
  "cuda": [
    ("P = 2", _case("P = 2")),
    ("P = 4, d = 64", _case("P = 4, d = 64")),
    (
      "GQA: Llama 3 8B shapes, IHA P = 4, one of 4 sequence shards",
      dataclasses.replace(GQA_CASES[2][1], shards=4),
    ),
    ("control: 128 x 128 tiles at P = 2", dataclasses.replace(_case("P = 2"), blocks=(128, 128))),
    # The on-chip window path (`kernels.window.gpu`): its forward kernel and its backward's
    # statistics, dQ and dK/dV kernels.
    (
      "on-chip: 2.4B L layer (P = H = 20)",
      Case(heads=20, num_pseudo=20, window=204, tokens=2048, onchip=True),
    ),
    (
      "on-chip: 2.4B L layer at P = 4",
      Case(heads=20, num_pseudo=4, window=1024, tokens=2048, onchip=True),
    ),
    # The same at the shipped N = 8192: more query tiles per backward program, which
    # ptxas allocates differently.
    (
      "on-chip: 2.4B L layer (P = H = 20), N = 8192",
      Case(heads=20, num_pseudo=20, window=204, tokens=8192, onchip=True),
    ),
    (
      "on-chip: 2.4B L layer at P = 4, N = 8192",
      Case(heads=20, num_pseudo=4, window=1024, tokens=8192, onchip=True),
    ),
  ],
}


# The shapes benchmarks/kernels.py times (B = 1, N = 8192, H = 20, d = 128, bf16,
# forward+backward): what a GPU compiles them to, beside its timings (`--cases timed`).
TIMED = [
  ("timed: window IHA, P = 2", Case(heads=20, num_pseudo=2, window=2048, tokens=8192)),
  ("timed: window IHA, P = 4", Case(heads=20, num_pseudo=4, window=1024, tokens=8192)),
  ("timed: global IHA, P = 4", Case(heads=20, num_pseudo=4, tokens=8192)),
  ("timed: global MHA", Case(kind="mha", heads=20, tokens=8192)),
]


def _summary(result) -> dict:
  out = {"ok": result.ok, "error": result.error, "seconds": round(result.seconds, 1)}
  if result.ok:
    report = result.report
    out["temp_bytes"] = report.temp_bytes
    out["kernels"] = {name: dataclasses.asdict(k) for name, k in report.by_kind().items()}
  return out


def worker(platform: str, which: str, on_device: bool = False) -> None:
  """Compiles the cases for every target of `platform` (or, `on_device`, for this
  process's own GPU); one JSON line per result."""
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import kernel_compiles  # pylint: disable=import-outside-toplevel
  from iha_jax.parallel import targets  # pylint: disable=import-outside-toplevel

  names = TPU_TARGETS if platform == "tpu" else GPU_TARGETS
  cases = {"smoke": SMOKE[platform], "timed": TIMED, "gqa": GQA_CASES}.get(which, CASES)
  if which == "smoke" and platform == "tpu":
    names = ("v5p-8",)
  if on_device:
    # On a GPU: the same cases compiled by its own jax/Triton/ptxas for the real device.
    names = ("h100",)
  else:
    targets.use_compile_packages(platform)
  for name in names:
    target = targets.parse(name)
    device = jax.devices()[0] if on_device else targets.devices(target)[0]
    for label, case in cases:
      result = kernel_compiles.compile_case(case, target, device)
      line = {"target": name, "case": label, "spec": case.label, **_summary(result)}
      print(json.dumps(line), flush=True)


def _mib(x: int) -> str:
  return f"{x / 2**20:.1f}"


def _cell(row: dict) -> str:
  if not row["ok"]:
    return f"**fails**: {row['error'][:120]}"
  kernels = row["kernels"]
  # The flash kernels in the header's order; other paths' kernels (the on-chip window
  # path's) by name.
  names = [k for k in KERNELS if k in kernels] or sorted(kernels)
  label = "" if names[0] in KERNELS else "{}: "
  if all(k.get("vmem_bytes") is not None for k in kernels.values()):
    return " / ".join(label.format(k) + _mib(kernels[k]["vmem_bytes"]) for k in names) + " MiB"
  parts = []
  for name in names:
    k = kernels[name]
    parts.append(
      f"{label.format(name)}{k['registers']} r, {k['spill_bytes']} B spill, "
      f"{k['shared_bytes'] // 1024} KiB smem, {k['tensor_cores']}"
    )
  return " / ".join(parts)


def render(rows: list[dict]) -> str:
  tpu = [r for r in rows if r["target"] in TPU_TARGETS]
  gpu = [r for r in rows if r["target"] in GPU_TARGETS]
  lines = [
    "Compiled, not run: these are the compilers' static figures (memory, registers, spills),",
    "never speed. Regenerate: `python benchmarks/compile_matrix.py --out docs/compile_matrix.md`",
    "(needs `make targets`). Shapes: batch 1, H = 8, d = 128, N = 4096, causal, bf16,",
    "forward+backward unless the case says otherwise; windows in virtual tokens.",
    "",
  ]
  if tpu:
    lines += [
      "### TPU (XLA:TPU + Mosaic, libtpu 0.0.42.1): scoped VMEM of forward / dQ / dK-dV",
      "",
      "Limit: 16 MiB per kernel (Mosaic's default scoped VMEM on v5e, v5p, v6e).",
      "",
      "| case | shape | " + " | ".join(TPU_TARGETS) + " |",
      "| --- | --- |" + " --- |" * len(TPU_TARGETS),
    ]
    for label in dict.fromkeys(r["case"] for r in tpu):
      cells = {r["target"]: r for r in tpu if r["case"] == label}
      spec = next(iter(cells.values()))["spec"]
      row = [_cell(cells[t]) if t in cells else "" for t in TPU_TARGETS]
      lines.append(f"| {label} | {spec} | " + " | ".join(row) + " |")
    lines.append("")
  if gpu:
    lines += [
      "### H100 (XLA:GPU + Triton + ptxas 12.9, sm_90a): forward / dQ / dK-dV",
      "",
      "Per kernel: registers per thread, spill stores, shared memory, tensor-core "
      "instructions (`wgmma` = Hopper warpgroup MMA; `+mma.sync`: some dots under 64 rows).",
      "",
      "| case | shape | H100 | temporaries MiB |",
      "| --- | --- | --- | --- |",
    ]
    for r in gpu:
      temp = _mib(r["temp_bytes"]) if r["ok"] else ""
      lines.append(f"| {r['case']} | {r['spec']} | {_cell(r)} | {temp} |")
    lines.append("")
  return "\n".join(lines)


def _sections(text: str) -> dict[str, str]:
  """The page's "### " sections by platform ("tpu", "cuda"), each up to the next one."""
  parts = text.split("### ")[1:]
  return {"tpu" if part.startswith("TPU") else "cuda": "### " + part for part in parts}


def _case_of(line: str) -> str | None:
  """The case of a table row (`| case | ...`), None for other lines and the header."""
  if not line.startswith("| ") or line.startswith(("| case ", "| ---")):
    return None
  return line.split("|")[1].strip()


def _merge_rows(old: str, new: str) -> str:
  """Section `old` with the rows of `new`'s cases replaced (new cases after its last row)."""
  rows = {_case_of(line): line for line in new.splitlines() if _case_of(line)}
  lines = old.rstrip("\n").splitlines()
  merged = [rows.pop(_case_of(line), line) if _case_of(line) else line for line in lines]
  last = max(i for i, line in enumerate(merged) if line.startswith("|"))
  return "\n".join(merged[: last + 1] + list(rows.values()) + merged[last + 1 :]) + "\n\n"


def _merged(path: Path, table: str, rows_only: bool = False) -> str:
  """`table`, plus the sections of the other platform kept from the page at `path`;
  `rows_only` (a subset of the cases): the page with just those rows replaced or added."""
  if not path.exists():
    return table
  old, new = _sections(path.read_text()), _sections(table)
  preamble = (path.read_text() if rows_only else table).split("### ")[0]
  if rows_only:
    new = {p: _merge_rows(old[p], new[p]) if p in old else new[p] for p in new}
  return preamble + "".join(new.get(p) or old.get(p, "") for p in ("tpu", "cuda"))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--platform", choices=("tpu", "cuda", "both"), default="both")
  parser.add_argument("--cases", choices=("all", "smoke", "timed", "gqa"), default="all")
  parser.add_argument("--json", action="store_true", help="print JSON lines, no table")
  parser.add_argument("--out", help="also write the markdown table here")
  parser.add_argument("--worker", choices=("tpu", "cuda"), help=argparse.SUPPRESS)
  parser.add_argument(
    "--on_device",
    action="store_true",
    help="on a GPU machine: compile the cases for its own GPU, print JSON lines",
  )
  args = parser.parse_args()
  if args.worker:
    worker(args.worker, args.cases)
    return 0
  if args.on_device:
    worker("cuda", args.cases, on_device=True)
    return 0
  platforms = ("tpu", "cuda") if args.platform == "both" else (args.platform,)
  rows, start = [], time.perf_counter()
  for platform in platforms:
    command = [sys.executable, __file__, "--worker", platform, "--cases", args.cases]
    proc = subprocess.Popen(
      command,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    for line in proc.stdout:
      row = json.loads(line)
      rows.append(row)
      if args.json:
        print(line, end="", flush=True)
      else:
        status = "ok" if row["ok"] else "FAILS"
        print(
          f"[{time.perf_counter() - start:5.0f} s] {row['target']}: {row['case']}: {status}",
          flush=True,
        )
    if proc.wait():
      print(f"the {platform} worker exited with status {proc.returncode}", file=sys.stderr)
      return proc.returncode
  if not args.json:
    table = render(rows)
    print(table)
    if args.out:
      Path(args.out).write_text(_merged(Path(args.out), table, rows_only=args.cases == "gqa"))
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
