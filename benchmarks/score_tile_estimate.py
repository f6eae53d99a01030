"""The on-chip TPU window path's score-tile chain alone, estimated on one v5p chip.

    python benchmarks/score_tile_estimate.py                     # [160, 384] tiles, W = 204
    python benchmarks/score_tile_estimate.py --rows 288 --keys 512
    python benchmarks/score_tile_estimate.py --layout keys_on_sublanes --rows 128

A Pallas kernel that runs only what `window.tpu_kernel.forward_kernel` does per score tile
(scores of `rows` queries against `keys` keys, an additive band mask, a softmax in log2
units, probabilities times values, the normalised rows stored) over one head's 3200 rows
per grid step, 20 heads; no mixing, no collapse. It tries a tile shape or layout in a
minute where the whole path's estimate takes several. `--layout keys_on_sublanes` holds
the scores transposed (`[keys, rows]`: the reductions run across vregs, not lanes) and
writes `o` transposed. Prints the kernel's estimated ns per query row: an ESTIMATE from
libtpu's schedule (docs/performance.md §14), never a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
  sys.path.insert(0, str(_REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from iha_jax.estimate import chips, tpu  # noqa: E402
from iha_jax.kernels.tpu import NN, NT, TN  # noqa: E402
from iha_jax.kernels.window.tpu_kernel import reciprocal, unnormalised_softmax  # noqa: E402
from iha_jax.parallel import targets  # noqa: E402

HEAD_ROWS, HEADS, D = 3200, 20, 128


def _dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def kernel_call(rows: int, keys: int, transposed: bool, unroll: int):
  """(the jitted call, its ShapeDtypeStruct arguments on a compile-only v5p chip)."""
  blocks = HEAD_ROWS // rows

  def kernel(q_ref, k_ref, v_ref, bias_ref, o_ref):
    def block(i, carry):
      t0 = pl.multiple_of(i * rows, 16)
      q, k, v = q_ref[pl.ds(t0, rows), :], k_ref[pl.ds(t0, keys), :], v_ref[pl.ds(t0, keys), :]
      if transposed:  # scores [keys, rows]: reductions over sublanes and vregs
        s = _dot(k, q, NT) + bias_ref[...]
        m = jnp.max(s, axis=0, keepdims=True)
        p = jnp.exp2(s - m)
        o = _dot(v, p.astype(v.dtype), TN)  # o^T [d, rows]
        o_ref[:, pl.ds(t0, rows)] = (o * reciprocal(jnp.sum(p, axis=0, keepdims=True))).astype(
          o_ref.dtype
        )
      else:  # the kernel's own chain: scores [rows, keys], reductions over lanes
        p, total = unnormalised_softmax(_dot(q, k, NT) + bias_ref[...])
        o = _dot(p.astype(v.dtype), v, NN)
        o_ref[pl.ds(t0, rows), :] = (o * reciprocal(total)).astype(o_ref.dtype)
      return carry

    lax.fori_loop(0, blocks, block, 0, unroll=unroll)

  bias_shape = (keys, rows) if transposed else (rows, keys)
  out_shape = (HEADS, D, HEAD_ROWS) if transposed else (HEADS, HEAD_ROWS, D)
  per_head = lambda r, c: pl.BlockSpec((None, r, c), lambda h: (h, 0, 0))

  def call(q, k, v, bias):
    return pl.pallas_call(
      kernel,
      grid=(HEADS,),
      in_specs=[
        per_head(HEAD_ROWS, D),
        per_head(HEAD_ROWS + keys, D),
        per_head(HEAD_ROWS + keys, D),
        pl.BlockSpec(bias_shape, lambda h: (0, 0)),
      ],
      out_specs=per_head(*out_shape[1:]),
      out_shape=jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
      name="score_tiles",
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    )(q, k, v, bias)

  device = targets.devices(targets.parse("v5p-8"))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  band = (HEADS, HEAD_ROWS + keys, D)
  args = (
    spec((HEADS, HEAD_ROWS, D), jnp.bfloat16),
    spec(band, jnp.bfloat16),
    spec(band, jnp.bfloat16),
    spec(bias_shape, jnp.float32),
  )
  return jax.jit(call), args, blocks


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, default=160, help="query rows per score tile")
  parser.add_argument("--keys", type=int, default=384, help="keys per score tile (lanes)")
  parser.add_argument(
    "--layout", choices=("keys_on_lanes", "keys_on_sublanes"), default="keys_on_lanes"
  )
  parser.add_argument("--unroll", type=int, default=4)
  args = parser.parse_args(argv)
  if args.rows % 16 or args.keys % 128 or args.rows > HEAD_ROWS:
    parser.error("--rows: a multiple of 16 up to 3200; --keys: a multiple of 128")
  tpu.prepare()
  transposed = args.layout == "keys_on_sublanes"
  jitted, shapes, blocks = kernel_call(args.rows, args.keys, transposed, args.unroll)
  estimate = tpu.estimate(jitted, *shapes, target="v5p")
  kernel = max(estimate.ops, key=lambda op: op.total_s)
  rows = HEADS * blocks * args.rows
  cores = chips.chip("v5p").cores
  print(
    f"score tiles [{args.rows}, {args.keys}] ({args.layout}), {blocks} per head and step: "
    f"{kernel.seconds * 1e3:.4f} ms, {kernel.seconds * 1e9 * cores / rows:.3f} ns per query "
    "row per core (ESTIMATE from libtpu's schedule, one v5p chip; not a measurement)"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
