"""The token embedding's gradient on one TPU chip, estimated: XLA's scatter-add against the
one-hot matmul (`iha_jax.models.embedding`), at the shapes the configs train.

    python benchmarks/embedding_gradient.py [--target v5p] [--shapes T:V:D,...]

Each program is the table's gradient of one chip's tokens (T tokens, a V x D table,
the bfloat16 cotangent summed in float32), compiled for a compile-only chip; the times
come from libtpu's schedule (`iha_jax.estimate.tpu`): ESTIMATES, not measurements. Also
printed: the matmul's MXU work at the chip's peak and each program's temporary memory
(the one-hot is fused into the matmul when it is ~0).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iha_jax.estimate import chips  # noqa: E402
from iha_jax.estimate import tpu as tpu_estimate  # noqa: E402
from iha_jax.parallel import targets  # noqa: E402

# Per chip: the 2.4B step on v5p-128 (2 x 8192 tokens, Llama 3's vocabulary, width
# 2560), the 350M step on v5p-8 (8 x 4096 tokens over 4 chips), configs/default.py.
SHAPES = "16384:128256:2560,8192:32768:1024,2048:512:256"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="v5p", choices=sorted(chips.CHIPS))
  parser.add_argument("--shapes", default=SHAPES, help="T:V:D per chip, comma-separated")
  args = parser.parse_args(argv)
  tpu_estimate.prepare()
  slice_name = f"{args.target}-8" if args.target == "v5p" else f"{args.target}-4"
  device = targets.devices(targets.parse(slice_name))[0]

  import jax
  import jax.numpy as jnp

  from iha_jax.models import embedding

  sharding = jax.sharding.SingleDeviceSharding(device)
  chip = chips.CHIPS[args.target]
  print(
    f"The embedding gradient per {args.target} chip, estimated from libtpu's schedule "
    "(ESTIMATES, not measurements)"
  )
  print(
    f"{'T':>6} {'V':>7} {'D':>5} {'scatter est. ms':>16} {'matmul est. ms':>15} "
    f"{'matmul MXU floor':>17} {'scatter / matmul':>17} {'matmul temp MiB':>16}"
  )
  for shape in args.shapes.split(","):
    tokens, vocab, width = (int(x) for x in shape.split(":"))
    times, temps, bounds = {}, {}, {}
    for form in ("scatter", "matmul"):

      def grad(table, ids, cotangent, form=form):
        _, vjp = jax.vjp(lambda t: embedding.lookup(t, ids, jnp.bfloat16, form), table)
        return vjp(cotangent)[0]

      specs = (
        jax.ShapeDtypeStruct((vocab, width), jnp.float32, sharding=sharding),
        jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding),
        jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16, sharding=sharding),
      )
      (compiled, _), est = tpu_estimate.estimate_traced(
        jax.jit(grad).trace(*specs), target=args.target
      )
      times[form] = est.seconds
      bounds[form] = "at least " if est.lower_bound else ""
      temps[form] = compiled.memory_analysis().temp_size_in_bytes
    floor = 2 * tokens * vocab * width / chip.peak_bf16_flops
    print(
      f"{tokens:>6} {vocab:>7} {width:>5} {bounds['scatter']}{times['scatter'] * 1e3:>7.2f} "
      f"{times['matmul'] * 1e3:>15.2f} {floor * 1e3:>17.2f} "
      f"{times['scatter'] / times['matmul']:>17.1f} {temps['matmul'] / 2**20:>16.1f}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
