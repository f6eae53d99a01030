"""Mosaic GPU, first look: jax's own Hopper attention (FlashAttention-3 written in Pallas
Mosaic GPU, `jax.experimental.pallas.ops.gpu.attention_mgpu`) compiled for an H100 on this
CPU host, and what the compile reports.

    make targets SET=newest     # the newest set's venv and compile packages (jax 0.12)
    IHA_TARGETS_DIR=.targets-newest .venv-newest/bin/python benchmarks/mosaic_gpu_probe.py \
      [--causal] [--backward]

Mosaic GPU is the Pallas GPU backend that replaces Triton (jax 0.12 warns that Pallas'
Triton backend will be removed). This lowers the example for a compile-only H100
(`iha_jax.parallel.targets`) and compiles it with XLA:GPU; Mosaic builds each kernel's PTX
inside that compile and runs ptxas on it, and with `MOSAIC_GPU_DUMP_TO` set it writes the
PTX, ptxas' report and the kernel's resources there. Printed per kernel: threads
(`.maxntid`), registers, spill bytes and barriers (ptxas -v), shared-memory scratch
(Mosaic's resources), its tensor-core (`wgmma`) and TMA (`cp.async.bulk.tensor`)
instructions. Compiled, not run: none of this is speed. No IHA kernel is ported here.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The example reads the CUDA plugin's version module when jax is imported
# (`jax._src.lib.cuda_versions`), so the compile packages (`targets.packages_dir("cuda")`)
# go on sys.path before jax is.
sys.path.append(str(Path(os.environ.get("IHA_TARGETS_DIR", ROOT / ".targets")) / "cuda"))

from iha_jax.parallel import targets  # noqa: E402


def _kernel_figures(dump: Path) -> list[dict]:
  """One dict per kernel Mosaic compiled (`<name>.ptx`, `.ptxas`, `.resources.txt`)."""
  figures = []
  for ptx_path in sorted(dump.glob("*.ptx")):
    ptx = ptx_path.read_text()
    ptxas = ptx_path.with_suffix(".ptxas").read_text()
    resources = ptx_path.with_name(ptx_path.stem + ".resources.txt").read_text()
    threads = re.search(r"\.maxntid (\d+), (\d+), (\d+)", ptx)
    number = lambda pattern, text: int(re.search(pattern, text).group(1))
    figures.append(
      dict(
        kernel=ptx_path.stem,
        threads=threads and int(threads[1]) * int(threads[2]) * int(threads[3]),
        registers=number(r"Used (\d+) registers", ptxas),
        spill_bytes=number(r"(\d+) bytes spill stores", ptxas),
        barriers=number(r"used (\d+) barriers", ptxas),
        smem_scratch_bytes=number(r"smem_scratch_bytes=(\d+)", resources),
        wgmma=dict(collections.Counter(re.findall(r"wgmma\.mma_async\.\S*?\.(m\d+n\d+k\d+)", ptx))),
        tma_copies=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
      )
    )
  return figures


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--backward", action="store_true", help="forward+backward (jax.grad)")
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--heads", type=int, default=20)
  parser.add_argument("--head_dim", type=int, default=128)
  args = parser.parse_args()

  target = targets.parse("h100")
  device = targets.devices(target)[0]  # loads the compiler (use_compile_packages)

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=C0415
  except ImportError as error:
    print(f"no Mosaic GPU attention example in jax {jax.__version__}: {error}")
    return 1

  # float16: the example's shared-memory buffers are float16 whatever q's dtype (bfloat16
  # inputs are refused while tracing in jax 0.12.0.1), as its own benchmark runs it.
  shape = (1, args.tokens, args.heads, args.head_dim)
  x = jax.ShapeDtypeStruct(shape, jnp.float16, sharding=jax.sharding.SingleDeviceSharding(device))
  # The example's own benchmark blocks; its backward needs its four blocks named.
  backward_blocks = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  config = attention_mgpu.TuningConfig(
    block_q=64,
    block_kv=128,
    max_concurrent_steps=2,
    causal=args.causal,
    **(backward_blocks if args.backward else {}),
  )
  attend = forward = functools.partial(attention_mgpu.attention, config=config)
  if args.backward:
    loss = lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32))
    attend = jax.grad(loss, argnums=(0, 1, 2))
  with tempfile.TemporaryDirectory(prefix="iha_mosaic_gpu_") as directory:
    # Where Mosaic GPU writes each kernel's resources (while lowering), PTX and ptxas report
    # (while XLA compiles).
    dump = dict(MOSAIC_GPU_DUMP_TO=directory, MOSAIC_GPU_DUMP_RESOURCES="1")
    os.environ.update(dump, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
    try:
      with targets.lowering_for("cuda"):
        lowered = jax.jit(attend).lower(x, x, x)
    except (NotImplementedError, ValueError) as error:  # what the example refuses
      print(f"jax {jax.__version__}: the example refuses this case: {error}")
      return 1
    compiled = lowered.compile()
    kernels = _kernel_figures(Path(directory))
  calls = compiled.as_text().count('custom_call_target="mosaic_gpu_v2"')
  memory = compiled.memory_analysis()
  print(
    f"jax {jax.__version__}, Mosaic GPU attention for {target.name} (compiled, not run): "
    f"B, N, H, d = {shape}, float16, {'causal' if args.causal else 'bidirectional'}, "
    f"{'forward+backward' if args.backward else 'forward'}; {calls} Mosaic GPU custom calls, "
    f"{memory.temp_size_in_bytes / 2**20:.1f} MiB of XLA temporaries"
  )
  for k in kernels:
    print(
      f"  {k['kernel']}: {k['threads']} threads, {k['registers']} registers/thread, "
      f"{k['spill_bytes']} B spill stores, {k['barriers']} barriers, "
      f"{k['smem_scratch_bytes']} B shared-memory scratch, wgmma {k['wgmma']}, "
      f"{k['tma_copies']} TMA copies in the PTX"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
