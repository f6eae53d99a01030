"""Checks the collective model of `iha_jax.estimate.ici` on programs whose time is known
by arithmetic: collectives of known size over one ring of a v5p-128 slice (4x4x4 chips,
every axis a ring).

    python benchmarks/ici_calibration.py [--mib 64] [--json FILE]

Each program is one collective inside `shard_map` over the slice's x axis (4 chips, a
ring: 2 links per chip, 100 GB/s per link and direction), compiled by libtpu for the
compile-only slice; the model reads it from the compiled HLO. Known: a ring all-gather
(or reduce-scatter) of V bytes per chip takes (n-1)/n * V / (2 * 100 GB/s), an
all-reduce twice that. Exit status 1 when one is off by more than the tolerance. These
are estimates checked against arithmetic, not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iha_jax.estimate import tpu as tpu_estimate  # noqa: E402
from iha_jax.parallel import targets  # noqa: E402

TOLERANCE = 0.01  # the model is this arithmetic: a miss means it misread the program


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mib", type=int, default=64, help="V: gathered bytes per chip, MiB")
  parser.add_argument("--json", type=Path, default=None, help="write the rows here")
  args = parser.parse_args(argv)
  tpu_estimate.prepare()
  devices = targets.devices(targets.parse("v5p-128"))

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  grid = np.empty((4, 4, 4), dtype=object)
  for device in devices:
    grid[tuple(device.coords)] = device
  mesh = Mesh(grid, ("x", "y", "z"))
  ring = mesh.shape["x"]
  link = 100e9  # bytes/s per link and direction (https://cloud.google.com/tpu/docs/v5p)
  rows = args.mib * 2**20 // (4 * 1024)  # float32 rows of 1024 per chip's V
  shard = lambda f: jax.jit(  # noqa: E731
    jax.shard_map(f, mesh=mesh, in_specs=P(("x", "y", "z")), out_specs=P(("x", "y", "z")))
  )
  programs = [
    # (name, program, input rows per chip, V bytes per chip, collective time known)
    ("all-gather", shard(lambda a: jax.lax.all_gather(a, "x", tiled=True)), rows // ring, 1.0),
    ("reduce-scatter", shard(lambda a: jax.lax.psum_scatter(a, "x", tiled=True)), rows, 1.0),
    ("all-reduce", shard(lambda a: jax.lax.psum(a, "x")), rows, 2.0),
  ]
  results = []
  print(
    "Collective model against arithmetic on a v5p-128 slice's x ring (4 chips; estimates "
    "checked against arithmetic, not measurements)"
  )
  for name, program, local_rows, factor in programs:
    spec = jax.ShapeDtypeStruct(
      (local_rows * len(devices), 1024),
      jnp.float32,
      sharding=NamedSharding(mesh, P(("x", "y", "z"))),
    )
    volume = rows * 1024 * 4
    known = factor * (ring - 1) / ring * volume / (2 * link)
    est = tpu_estimate.estimate(program, spec)
    found = [c for c in est.communication.collectives if c.kind == name]
    modelled = sum(c.total_s for c in found)
    error = modelled / known - 1
    within = len(found) == 1 and abs(error) <= TOLERANCE
    results.append(
      dict(
        collective=name,
        bytes_per_chip=volume,
        known_ms=known * 1e3,
        modelled_ms=modelled * 1e3,
        error=error,
        tolerance=TOLERANCE,
        group=found[0].group if found else "",
        within=within,
      )
    )
    print(
      f"  {name:<15} V {volume / 2**20:6.1f} MiB  model {modelled * 1e3:8.4f} ms  known "
      f"{known * 1e3:8.4f} ms  {error:+6.2%} (tolerance {TOLERANCE:.0%}) "
      f"{'ok' if within else 'OUT OF TOLERANCE'}  [{found[0].group if found else 'not found'}]"
    )
  if args.json:
    args.json.write_text(json.dumps(results, indent=1) + "\n")
  return 0 if all(r["within"] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
