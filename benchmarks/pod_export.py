"""Exports the paper-scale train step for a TPU pod (or a GPU cluster) from this machine.

    python benchmarks/pod_export.py [--devices 64] [--platform tpu] [--config configs/iha_2p4b.py]

The 2.4B model's real train step (scan over layers, the config's remat policy, AdamW) on
an FSDP mesh of `--devices` fake CPU devices (64 = a v5p-128 slice's chips), per-device
batch 1 at the config's sequence length, lowered with `jax.export` for `--platform`: the
Pallas kernels (Mosaic for TPU, Triton for CUDA) are lowered for real. Prints the time
taken, the StableHLO size, and where the kernel calls sit (all inside manual-sharding
regions that take the batch split: `iha_jax.train.export.kernel_placement`). Exit status
1 if any kernel call sits outside. Nothing runs on the target: what XLA's TPU compiler
and the hardware make of it is not checked here.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/iha_2p4b.py")
  parser.add_argument("--devices", type=int, default=64)
  parser.add_argument("--platform", choices=("tpu", "cuda"), default="tpu")
  parser.add_argument("--per_device_batch", type=int, default=1)
  parser.add_argument(
    "--vocab_size",
    type=int,
    default=128256,
    help="when the config reads it from a tokenizer file (Llama 3's)",
  )
  args = parser.parse_args()
  # Before JAX starts: the fake devices of the mesh.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
  )
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  # pylint: disable=import-outside-toplevel
  import jax

  from iha_jax import parallel
  from iha_jax.train import config as config_lib
  from iha_jax.train import export

  config = runpy.run_path(args.config)["get_config"]()
  if config.model.vocab_size == -1:
    config.model.vocab_size = args.vocab_size
  config.model.implementation = "pallas_tpu" if args.platform == "tpu" else "pallas_gpu"
  model_cfg = config_lib.model_config(config)
  mesh = parallel.create_mesh(dict(data=1, fsdp=args.devices, tensor=1))
  batch = args.per_device_batch * args.devices
  seq_len = config.data.seq_len
  print(
    f"{args.config} for {args.platform} on {len(jax.devices())} fake devices, mesh "
    f"{dict(mesh.shape)}, batch {batch} x {seq_len} tokens, remat "
    f"{config.model.remat_policy}, scan_layers {config.model.scan_layers}"
  )
  start = time.perf_counter()
  exported = export.export_train_step(
    model_cfg,
    config.train,
    mesh,
    batch_size=batch,
    seq_len=seq_len,
    platform=args.platform,
    remat=config.model.remat_policy,
    scan_layers=config.model.scan_layers,
    accum_steps=config.train.grad_accum_steps,
  )
  text = exported.mlir_module()
  seconds = time.perf_counter() - start
  placement = export.kernel_placement(text)
  print(
    f"exported in {seconds:.0f} s: {len(text) / 2**20:.1f} MiB of StableHLO, "
    f"{exported.nr_devices} devices, platforms {exported.platforms}"
  )
  print(
    f"kernel calls inside shard_map regions: {placement.inside}, outside: "
    f"{placement.outside}; regions holding kernels: {len(placement.regions)}"
  )
  for shardings in sorted(set(placement.regions)):
    print(f"  in_shardings[:3] {shardings.split('>, ')[:3]}")
  return 0 if placement.inside and not placement.outside else 1


if __name__ == "__main__":
  sys.exit(main())
