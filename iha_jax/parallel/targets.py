"""Compile-only devices of hardware this machine lacks: TPU slices and NVIDIA H100s.

`devices("v5p-128")` returns the 64 chips of a v5p-128 slice as devices that XLA can
compile for (never run on): `jax.experimental.topologies` over libtpu (TPU) or over the
CUDA PJRT plugin with an H100 target description and ptxas (GPU). A program lowered on a
mesh of them and compiled runs the targets' own compilers (XLA:TPU with Mosaic, XLA:GPU
with Triton and ptxas): compile errors, memory per device and each kernel's static
resources are real; speed is not measured.

The compilers come from packages the CPU install leaves out (they would make every CPU
process load TPU/GPU runtimes): `make targets` puts them in `.targets/tpu` and
`.targets/cuda` (pinned in requirements-targets-{tpu,cuda}.txt), and
`use_compile_packages(platform)` puts one of them on `sys.path` before JAX starts its
backends.

Lowering Pallas GPU (Triton) kernels without a GPU needs the GPU named: jax 0.11+ reads
the architecture from the current abstract mesh's device and refuses otherwise ("No
supported GPU devices found"); `lowering_for("cuda")` names the H100 (jax 0.10.2 has the same
API and assumed sm_90 itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import jax

from iha_jax.errors import UserError

GiB = 2**30
# `make targets` installs here; IHA_TARGETS_DIR overrides.
PACKAGES_DIR = Path(__file__).resolve().parents[2] / ".targets"
H100_SPEC = Path(__file__).with_name("h100_sxm.txtpb")


class TargetError(UserError, ValueError):
  """An unknown target, or its compiler packages are missing."""


@dataclasses.dataclass(frozen=True)
class Target:
  """A compile target.

  Attributes:
    name: e.g. "v5p-128", "h100x8".
    platform: "tpu" or "cuda".
    chips: devices a mesh spans (one per chip; a v5p/v4 chip's two cores act as one).
    hbm_bytes: memory per chip (public specifications).
    topology: `get_topology_desc`'s topology name ("v5p:4x4x4") or GPU "1x1xN".
    chip_config: TPU "megacore" (v4, v5p) or "default".
  """

  name: str
  platform: str
  chips: int
  hbm_bytes: int
  topology: str
  chip_config: str = "default"

  @property
  def kernel_platform(self) -> str:
    """The `implementation` suffix of this target's Pallas kernels."""
    return "tpu" if self.platform == "tpu" else "gpu"


# Generation -> (chip config, HBM per chip, cores named in the slice size, mesh rank).
_TPU = {
  "v4": ("megacore", 32 * GiB, 2, 3),
  "v5p": ("megacore", 95 * GiB, 2, 3),
  "v5e": ("default", 16 * GiB, 1, 2),
  "v6e": ("default", 32 * GiB, 1, 2),
}
H100_HBM = 84_942_979_072  # the H100 SXM spec's device_memory_size (79.1 GiB)
# The H100 as lowering sees it: the spec's device_description_str (what a compile-only
# device of `devices("h100")` reports as its kind) and its 132 SMs.
H100_DEVICE = jax.sharding.AbstractDevice(
  device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
)
EXAMPLES = ("v5p-8", "v5p-128", "v5e-256", "v6e-256", "v4-128", "h100", "h100x8")


def _torus(chips: int, rank: int) -> str:
  """Slice shape of `chips` chips: `2x2x1`, `4x4x4` (3-D) or `16x16` (2-D), as GCP's."""
  dims = [1] * rank
  if rank == 3:
    dims[:2] = [min(chips, 2), max(1, min(chips // 2, 2))]
  while math.prod(dims) < chips:
    dims[dims.index(min(dims))] *= 2
  if math.prod(dims) != chips:
    raise TargetError(f"no slice of {chips} chips")
  return "x".join(str(d) for d in dims)


def parse(name: str) -> Target:
  """`v5p-128` (TensorCores for v4/v5p, chips for v5e/v6e, as GCP names slices),
  `h100` or `h100xN` (N GPUs of one host)."""
  match = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name)
  if match:
    generation, size = match.group(1), int(match.group(2))
    chip_config, hbm, cores, rank = _TPU[generation]
    chips = size // cores
    if size % cores or chips < 1 or chips & (chips - 1):
      raise TargetError(
        f"--target={name}: {generation} slices come in powers of two"
        f"{' of TensorCores (2 per chip)' if cores == 2 else ' of chips'}, e.g. "
        f"{generation}-{8 * cores}"
      )
    topology = f"{generation}:{_torus(chips, rank)}"
    return Target(name, "tpu", chips, hbm, topology, chip_config)
  match = re.fullmatch(r"h100(?:x(\d+))?", name)
  if match:
    gpus = int(match.group(1) or 1)
    if not 1 <= gpus <= 8:
      raise TargetError(f"--target={name}: one host holds 1 to 8 H100s (h100, h100x8)")
    return Target(name, "cuda", gpus, H100_HBM, f"1x1x{gpus}")
  raise TargetError(
    f"unknown --target={name!r}; known kinds: v4-N, v5p-N, v5e-N, v6e-N, h100, h100xN "
    f"(e.g. {', '.join(EXAMPLES)})"
  )


@contextlib.contextmanager
def lowering_for(platform: str, gpu: jax.sharding.AbstractDevice = H100_DEVICE) -> Iterator[None]:
  """Lowers for `platform` inside: for "cuda", Pallas Triton kernels for `gpu` (an H100)
  from a host without one (`jax.export(..., platforms=["cuda"])`, `.lower(
  lowering_platforms=("cuda",))`, or `jit(...).lower` on a compile-only GPU device);
  nothing for other platforms, or on a GPU machine (Triton lowers for the local GPU).

  The current mesh's axes are kept (its shardings still apply), only its device is
  replaced; without a mesh an empty one carries the device.
  """
  if platform != "cuda" or jax.default_backend() == "gpu":
    yield
    return
  mesh = jax.sharding.get_abstract_mesh()
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=gpu)):
    yield


def packages_dir(platform: str) -> Path:
  """Where `make targets` installed `platform`'s ("tpu" or "cuda") compiler packages."""
  return Path(os.environ.get("IHA_TARGETS_DIR", PACKAGES_DIR)) / platform


def use_compile_packages(platform: str, accelerator: str = "v5p-8") -> None:
  """Makes `platform`'s compiler importable; call before JAX starts its backends.

  `accelerator` names the TPU slice for libtpu's start-up (it otherwise asks a cloud
  metadata server and prints warnings). Raises TargetError (one line, naming `make
  targets`) when the packages are not installed.
  """
  directory = packages_dir(platform)
  if directory.is_dir() and str(directory) not in sys.path:
    sys.path.append(str(directory))
  # The host runs on the CPU backend; the targets only compile.
  jax.config.update("jax_platforms", "cpu")
  if platform == "tpu":
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # No TPU is opened: several compiling processes (test workers) may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  nvcc = directory / "nvidia" / "cuda_nvcc"
  if (
    platform == "cuda"
    and nvcc.is_dir()
    and "xla_gpu_cuda_data_dir" not in os.environ.get("XLA_FLAGS", "")
  ):
    # XLA's ptxas and libdevice: the pinned package's, not whatever CUDA the host has.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_cuda_data_dir={nvcc}"
  module = "libtpu" if platform == "tpu" else "jax_plugins.xla_cuda12"
  try:
    found = importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    found = False
  if not found:
    raise TargetError(
      f"compiling for {platform.upper()} needs {module} (not installed): run `make targets` "
      f"(installs requirements-targets-{platform}.txt into {directory}), or set IHA_TARGETS_DIR"
    )


def ptxas() -> Path:
  """The ptxas that XLA runs for deviceless GPU compiles (nvidia-cuda-nvcc-cu12), else
  the CUDA toolkit's on PATH (a GPU machine's own compiles)."""
  for root in [packages_dir("cuda"), *map(Path, sys.path)]:
    candidate = root / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    if candidate.is_file():
      return candidate
  found = shutil.which("ptxas") or shutil.which("ptxas", path="/usr/local/cuda/bin")
  if found:
    return Path(found)
  raise TargetError("ptxas not found: run `make targets`")


def devices(target: Target) -> list[jax.Device]:
  """The target's compile-only devices (loads its compiler; `use_compile_packages` first)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  use_compile_packages(target.platform, target.name)
  if target.platform == "tpu":
    description = topologies.get_topology_desc(
      platform="tpu",
      topology_name=target.topology,
      chip_config_name=target.chip_config,
      chips_per_host_bounds=(2, 2, 1),
      num_slices=1,
    )
  else:
    description = topologies.get_topology_desc(
      platform="cuda", target_config=H100_SPEC.read_text(), topology=target.topology
    )
  found = list(description.devices)
  if len(found) != target.chips:
    raise TargetError(
      f"{target.name}: expected {target.chips} devices, the compiler made {len(found)}"
    )
  return found
