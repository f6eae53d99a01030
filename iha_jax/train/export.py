"""The sharded train step exported for a platform this machine lacks, and where its kernels sit.

`export_train_step` lowers the real train step (the `train.py` step: same model, optimizer,
shardings and logical-axis rules) with `jax.export` for a target platform, on a mesh of
any size (on CPU, `--xla_force_host_platform_device_count` fakes the devices): a pod's
program is checked without the pod. `kernel_placement` reads the exported StableHLO and
says whether every Pallas kernel's custom call runs inside a manual-sharding region
(`sdy.manual_computation`, what `jax.shard_map` lowers to) and how that region takes its
operands: a kernel outside one, or a region that takes the batch dimension whole, means
XLA would gather the global batch onto every device.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh

from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM, TransformerConfig
from iha_jax.parallel import targets
from iha_jax.train.lowering import abstract_batch
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import abstract_state
from iha_jax.train.step import make_train_step

# The custom-call targets of the Pallas kernels: Mosaic (TPU) and Triton (GPU).
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


def export_train_step(
  model_cfg: TransformerConfig,
  train_cfg: Any,
  mesh: Mesh,
  *,
  batch_size: int,
  seq_len: int,
  platform: str = "tpu",
  remat: str = "none",
  scan_layers: bool = False,
  accum_steps: int = 1,
) -> jax.export.Exported:
  """`jax.export` of the jitted, sharded train step of `model_cfg` for `platform`.

  Args:
    model_cfg: the model; its `implementation` picks the kernels (e.g. "pallas_tpu").
    train_cfg: the `train` config section (optimizer and schedule).
    mesh: the training mesh (`iha_jax.parallel.create_mesh`).
    batch_size, seq_len: the global batch `[batch_size, seq_len]`.
    platform: "tpu" or "cuda".
  """
  model = FunctionalTransformerLM(model_cfg, remat=remat, scan_layers=scan_layers)
  tx = make_optimizer(train_cfg)
  target, shardings = abstract_state(model, tx, mesh)
  rows = parallel.batch_sharding(mesh)
  batch = abstract_batch(model_cfg, batch_size, seq_len, "cross_entropy", rows)
  step = make_train_step(model, tx, learning_rate_schedule(train_cfg), accum_steps)
  with parallel.activate(mesh):
    jitted = jax.jit(step, in_shardings=(shardings, rows), donate_argnums=0)
    # Triton calls carry no serialization-compatibility guarantee (Mosaic's do): allowed
    # explicitly, as a program exported for one jaxlib and run there.
    checks = [jax.export.DisabledSafetyCheck.custom_call(KERNEL_TARGETS[1])]
    export = jax.export.export(jitted, platforms=[platform], disabled_checks=checks)
    with targets.lowering_for(platform):  # Triton's GPU named (jax 0.11+), on this mesh
      return export(target, batch)


@dataclasses.dataclass
class KernelPlacement:
  """Where the kernel custom calls of an exported module sit.

  `inside`/`outside`: kernel calls inside / outside any manual-sharding region (calls in
  a private function count where that function is called from). `regions`: the
  `in_shardings` of every region that (transitively) holds a kernel call.
  """

  inside: int
  outside: int
  regions: list[str]


_FUNC = re.compile(r"func\.func (?:public |private )?@([\w$.-]+)")
_CALL = re.compile(r"(?:func\.)?call @([\w$.-]+)")
_IN_SHARDINGS = re.compile(r"in_shardings=\[(.*?)\] out_shardings")


def kernel_placement(text: str) -> KernelPlacement:
  """Reads `exported.mlir_module()`: MLIR prints a region as a line ending in `{` and
  closes it on a line starting with `}` (attribute braces stay within one line)."""
  # Per function: its kernel calls and calls to others, each flagged inside/outside.
  bodies: dict[str, list[tuple[str, bool, str]]] = {}
  # Per manual region: its in_shardings, direct kernel calls and the functions it calls.
  manual_regions: list[tuple[str, list[str]]] = []
  current, stack = None, []  # open regions: "func", "other" or the index of a manual one
  for line in text.splitlines():
    stripped = line.strip()
    if stripped.startswith("}") and stack:
      if stack.pop() == "func":
        current = None
    match = _FUNC.search(line)
    if match:
      current = match.group(1)
      bodies[current] = []
    regions_open = [entry for entry in stack if isinstance(entry, int)]
    if current is not None:
      if "custom_call" in line and any(target in line for target in KERNEL_TARGETS):
        bodies[current].append(("kernel", bool(regions_open), ""))
        if regions_open:
          manual_regions[regions_open[-1]][1].append("")
      for called in _CALL.findall(line):
        bodies[current].append(("call", bool(regions_open), called))
        if regions_open:
          manual_regions[regions_open[-1]][1].append(called)
    if stripped.endswith("{"):
      if match:
        stack.append("func")
      elif "sdy.manual_computation" in line:
        shardings = _IN_SHARDINGS.search(line)
        manual_regions.append((shardings.group(1) if shardings else line, []))
        stack.append(len(manual_regions) - 1)
      else:
        stack.append("other")

  inside = outside = 0

  def visit(name: str, manual: bool, seen: tuple[str, ...], count: bool) -> bool:
    """Whether `name` reaches a kernel call; counts them when `count`."""
    nonlocal inside, outside
    found = False
    for kind, here_manual, called in bodies.get(name, []):
      if kind == "kernel":
        found = True
        if count and (manual or here_manual):
          inside += 1
        elif count:
          outside += 1
      elif kind == "call" and called not in seen:
        found |= visit(called, manual or here_manual, seen + (called,), count)
    return found

  visit("main", False, ("main",), True)
  regions = [
    shardings
    for shardings, contents in manual_regions
    if any(c == "" or visit(c, True, (c,), False) for c in contents)
  ]
  return KernelPlacement(inside=inside, outside=outside, regions=regions)
