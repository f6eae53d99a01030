"""What a target's compiler says about a program: memory per device and each Pallas
kernel's static resources. Compiled, not run: these are never timings.

`compile_with_report(lowered)` compiles with XLA's dump switched on and reads:
- TPU: each Mosaic kernel's scoped VMEM (the `used_scoped_memory_configs` XLA:TPU writes
  into the optimized HLO);
- GPU: each Triton kernel's launch (grid, threads, shared memory, from XLA's thunk
  sequence), its tensor-core instructions (`wgmma` on Hopper, else `mma.sync`, from the
  PTX) and ptxas' registers, spill bytes and stack (`ptxas -v -arch=sm_90a` on that PTX,
  the ptxas XLA itself runs).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from iha_jax.parallel import targets

# Custom-call targets of Pallas kernels: Mosaic (TPU) and Triton (GPU).
KERNEL_CALLS = ("tpu_custom_call", "__gpu$xla.gpu.triton")
KERNEL_PREFIX = "iha_"  # the project's kernels are named iha_flash_forward, iha_flash_dq, ...
# jax 0.11+'s XLA:GPU writes the PTX into the dump only when this pattern matches the
# dump's tag "ptx" (it is matched against tags such as "ptx", "llvm", "triton-fusion",
# never kernel names); unset, jax 0.10.2's wrote PTX and LLVM IR always, jax 0.12's
# neither (no registers, spills or tensor cores). ".*" also writes LLVM IR and every
# emitter's MLIR pass logs (several times slower for a small compile;
# docs/compile_checks.md). XLA:TPU ignores it.
DUMP_OPTIONS = {"xla_dump_emitter_re": "ptx"}


@dataclasses.dataclass(frozen=True)
class Kernel:
  """Static resources of one compiled kernel (None: not reported on this platform)."""

  name: str
  vmem_bytes: int | None = None  # TPU scoped VMEM
  registers: int | None = None  # GPU, per thread
  spill_bytes: int | None = None  # GPU spill stores
  stack_bytes: int | None = None
  shared_bytes: int | None = None  # GPU dynamic shared memory of the launch
  threads: int | None = None
  tensor_cores: str | None = None  # GPU: "wgmma", "mma.sync", "wgmma+mma.sync" or "none"

  @property
  def kind(self) -> str:
    """`iha_flash_forward__1` -> `iha_flash_forward` (XLA numbers repeated kernels)."""
    return re.sub(r"(__\d+|\.\d+)$", "", self.name)


@dataclasses.dataclass(frozen=True)
class Report:
  """Per-device memory of a compiled program and its Pallas kernels."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  kernel_calls: int
  kernels: tuple[Kernel, ...]

  @property
  def total_bytes(self) -> int:
    """Peak per-device memory: arguments + outputs (less donated aliases) + temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def by_kind(self) -> dict[str, Kernel]:
    """The worst instance of each kernel kind (most VMEM, spills, registers)."""
    worst: dict[str, Kernel] = {}
    key = lambda k: (k.vmem_bytes or 0, k.spill_bytes or 0, k.registers or 0, k.shared_bytes or 0)
    for kernel in self.kernels:
      if kernel.kind not in worst or key(kernel) > key(worst[kernel.kind]):
        worst[kernel.kind] = kernel
    return dict(sorted(worst.items()))


def compile_with_report(lowered: Any) -> tuple[Any, Report]:
  """`lowered.compile()` for its (compile-only) target, and what the compiler reported.

  `IHA_XLA_DUMP_DIR=dir` keeps XLA's dump there (the optimised HLO, and on TPU its
  buffer assignment and memory-usage report: what holds the peak)."""
  keep = os.environ.get("IHA_XLA_DUMP_DIR")
  with tempfile.TemporaryDirectory(prefix="iha_xla_dump_") as scratch:
    dump = keep or scratch
    options = {"xla_dump_to": dump, **DUMP_OPTIONS}
    if keep:
      options["xla_dump_hlo_as_text"] = True
    compiled = lowered.compile(compiler_options=options)
    text = compiled.as_text()
    kernels = tuple(_tpu_kernels(Path(dump)) + _gpu_kernels(Path(dump)))
  memory = compiled.memory_analysis()
  return compiled, Report(
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    alias_bytes=memory.alias_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    code_bytes=memory.generated_code_size_in_bytes,
    kernel_calls=sum(text.count(f'custom_call_target="{c}"') for c in KERNEL_CALLS),
    kernels=kernels,
  )


_TPU_CALL = re.compile(r"^\s*%(\S+) = .*custom_call_target=\"tpu_custom_call\"")
_SCOPED = re.compile(r'used_scoped_memory_configs":\[\{[^]]*?"size":"(\d+)"')


def _tpu_kernels(dump: Path) -> list[Kernel]:
  kernels = []
  for path in dump.glob("*after_codegen.txt"):
    for line in path.read_text().splitlines():
      match = _TPU_CALL.match(line)
      if match and match.group(1).startswith(KERNEL_PREFIX):
        scoped = _SCOPED.search(line)
        kernels.append(Kernel(match.group(1), vmem_bytes=int(scoped.group(1)) if scoped else 0))
  return kernels


_LAUNCH = re.compile(
  r"kCustomKernel .*?\] (\S+) grid: \[[\d, ]+\] threads: \[(\d+), (\d+), (\d+)\]\s+"
  r"shared_memory: (\d+) bytes"
)
_PTXAS = {
  "registers": re.compile(r"Used (\d+) registers"),
  "spill_bytes": re.compile(r"(\d+) bytes spill stores"),
  "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
}


def _ptxas(ptx: Path, entry: str) -> dict[str, int]:
  """ptxas -v on one PTX file: registers, spill stores and stack of `entry`."""
  out = subprocess.run(
    [str(targets.ptxas()), "-v", "-arch=sm_90a", str(ptx), "-o", "/dev/null"],
    capture_output=True,
    text=True,
    check=True,
  ).stderr
  section = out.split(f"Function properties for {entry}")[-1]
  return {key: int(pattern.search(section).group(1)) for key, pattern in _PTXAS.items()}


def _tensor_cores(ptx_text: str) -> str:
  """Tensor-core instructions in the PTX: Hopper's `wgmma`, the older `mma.sync`, both
  (some dots of the kernel too small for wgmma's 64-row tiles), or none."""
  kinds = [k for k in ("wgmma", "mma.sync") if k + ("." if k == "wgmma" else "") in ptx_text]
  return "+".join(kinds) or "none"


def _gpu_kernels(dump: Path) -> list[Kernel]:
  launches: dict[str, tuple[int, int]] = {}
  for path in dump.glob("*thunk_sequence.txt"):
    for match in _LAUNCH.finditer(path.read_text()):
      threads = int(match.group(2)) * int(match.group(3)) * int(match.group(4))
      launches[match.group(1)] = (threads, int(match.group(5)))
  ptx_files: dict[str, Path] = {}
  for path in dump.glob("*.ptx"):
    for entry in re.findall(r"\.entry (\w+)\(", path.read_text()):
      if entry.startswith(KERNEL_PREFIX):
        ptx_files[entry] = path
  # A GPU machine's own compile may dump no PTX: its kernels still show in the launches.
  names = sorted(set(ptx_files) | {n for n in launches if n.startswith(KERNEL_PREFIX)})
  # ptxas takes seconds per kernel: run them side by side.
  with concurrent.futures.ThreadPoolExecutor() as pool:
    stats = list(pool.map(lambda n: _ptxas(ptx_files[n], n) if n in ptx_files else {}, names))
  kernels = []
  for name, resources in zip(names, stats):
    threads, shared = launches.get(name, (None, None))
    ptx = ptx_files.get(name)
    kernels.append(
      Kernel(
        name,
        threads=threads,
        shared_bytes=shared,
        tensor_cores=_tensor_cores(ptx.read_text()) if ptx else None,
        **resources,
      )
    )
  return kernels


def kernel_table(report: Report) -> list[str]:
  """Lines describing each kernel kind (worst instance), for printing."""
  lines = []
  counts = collections.Counter(k.kind for k in report.kernels)
  for kind, k in report.by_kind().items():
    if k.vmem_bytes is not None:
      lines.append(f"  {kind} x{counts[kind]}: scoped VMEM {k.vmem_bytes / 2**20:.2f} MiB")
    else:
      lines.append(
        f"  {kind} x{counts[kind]}: {k.registers} registers/thread, {k.spill_bytes} B spill "
        f"stores, {k.stack_bytes} B stack, {k.shared_bytes} B shared memory, "
        f"{k.threads} threads, tensor cores: {k.tensor_cores}"
      )
  return lines
