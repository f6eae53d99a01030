"""The one conformance harness: any implementation of any attention kind against the
kind's dense "reference" (float32, highest precision), forward and every gradient with a
random cotangent. tests/test_attention_kinds.py runs it for the XLA paths,
tests/test_kernels.py for the Pallas kernels (interpret mode on CPU), tests/test_gpu_paths.py
for the materialised GPU paths (cuDNN, pallas_gpu_mha)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from iha_jax import ops
from tests.utils import assert_close, packed_positions, packed_segments, random_iha_inputs


@dataclasses.dataclass(frozen=True)
class Kind:
  """How to build random inputs for one kind and call its entry point."""

  make: Callable[[jax.Array, int, int], tuple[jax.Array, ...]]  # (key, B, N) -> float32 args
  call: Callable[..., jax.Array]  # (*args, **options) -> output
  rope: bool = True  # takes positions


def normal(key: jax.Array, *shapes) -> tuple[jax.Array, ...]:
  keys = jax.random.split(key, len(shapes))
  return tuple(jax.random.normal(k, s) for k, s in zip(keys, shapes))


def iha(
  h: int,
  d: int,
  p: int,
  *,
  per_head: bool = False,
  rope_theta: float | None = 10000.0,
  kv_heads: int | None = None,
):
  """IHA with H = h heads of width d, P = p pseudo-heads and G = kv_heads key/value heads
  (None: G = H)."""
  return Kind(
    lambda key, b, n: random_iha_inputs(key, b, n, h, d, p, per_head=per_head, kv_heads=kv_heads),
    functools.partial(ops.iha_attention, rope_theta=rope_theta),
    rope=rope_theta is not None,
  )


def mha(h: int, d: int, dv: int, kv_heads: int | None = None) -> Kind:
  """MHA with values `dv` wide (differential attention uses dv = 2d) and G = kv_heads
  key/value heads (None: G = H)."""
  g = h if kv_heads is None else kv_heads
  return Kind(
    lambda key, b, n: normal(key, (b, n, h, d), (b, n, g, d), (b, n, g, dv)), ops.mha_attention
  )


def talking_heads(h: int, d: int) -> Kind:
  shapes = lambda b, n: [(b, n, h, d)] * 3 + [(h, h), (h, h)]
  return Kind(lambda key, b, n: normal(key, *shapes(b, n)), ops.talking_heads_attention)


def diff(h: int, d: int) -> Kind:
  shapes = lambda b, n: [(b, n, h, 2, d), (b, n, h, 2, d), (b, n, h, 2 * d), (h,)]
  return Kind(lambda key, b, n: normal(key, *shapes(b, n)), ops.diff_attention)


def simplicial(h: int, d: int) -> Kind:
  return Kind(
    lambda key, b, n: tuple(x * 0.7 for x in normal(key, *[(b, n, h, d)] * 5)),
    ops.simplicial_attention,
    rope=False,
  )


def options(
  kind: Kind,
  b: int,
  n: int,
  *,
  causal: bool,
  window: int | None,
  packed: bool = False,
  random_positions: bool = False,
) -> dict:
  """Mask options: packed = two documents and padding in row 0 (positions restart)."""
  out = dict(causal=causal, window=window)
  if packed:
    out["segment_ids"] = packed_segments(b, n)
    if kind.rope:
      out["positions"] = packed_positions(out["segment_ids"])
  if random_positions:
    out["positions"] = jnp.asarray(np.random.default_rng(0).integers(0, 4 * n, (b, n)), jnp.int32)
  return out


def value_and_grads(fn: Callable, args: tuple, cotangent: jax.Array):
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent.astype(out.dtype))


def check(
  kind: Kind,
  implementation: str,
  *,
  b: int,
  n: int,
  mask: dict,
  dtype=jnp.float32,
  blocks: ops.BlockSizes | None = None,
  seed: int = 0,
) -> None:
  """`implementation` (inputs rounded to `dtype`) against the reference on the same
  rounded values in float32: output (in `dtype`) and every input's gradient."""
  key, ct_key = jax.random.split(jax.random.key(seed))
  low = tuple(x.astype(dtype) for x in kind.make(key, b, n))
  exact = tuple(x.astype(jnp.float32) for x in low)  # the oracle sees the rounded values
  opts = options(kind, b, n, **mask)
  ref = jax.jit(lambda *a: kind.call(*a, implementation="reference", **opts))
  fast = jax.jit(
    lambda *a: kind.call(*a, implementation=implementation, block_sizes=blocks, **opts)
  )
  cotangent = jax.random.normal(ct_key, jax.eval_shape(ref, *exact).shape)
  want = value_and_grads(ref, exact, cotangent)
  # Mosaic kernels run under the TPU interpreter (SMEM/VMEM and grid order modelled);
  # Triton ones fall back to Pallas' interpreter off-GPU by themselves.
  interpret = pltpu.force_tpu_interpret_mode() if implementation == "pallas_tpu" else None
  with interpret or contextlib.nullcontext():
    got = value_and_grads(fast, low, cotangent)
  assert got[0].dtype == dtype
  assert_close(got[0], want[0], dtype, f"{implementation} out")
  assert_close(got[1], want[1], dtype, f"{implementation} grads")
