"""The one conformance harness: any implementation of any attention kind against the
kind's dense "reference" (float32, highest precision), forward and every gradient with a
random cotangent. tests/kinds/test_attention_kinds.py runs it for the XLA paths,
tests/kernels/test_kernels.py for the Pallas kernels (interpret mode on CPU),
tests/kernels/test_gpu_paths.py for the materialised GPU paths (cuDNN, pallas_gpu_mha)."""

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
from iha_jax.kinds import registry
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
  interpret = pltpu.force_tpu_interpret_mode() if implementation.startswith("pallas_tpu") else None
  with interpret or contextlib.nullcontext():
    got = value_and_grads(fast, low, cotangent)
  assert got[0].dtype == dtype
  assert_close(got[0], want[0], dtype, f"{implementation} out")
  assert_close(got[1], want[1], dtype, f"{implementation} grads")


def _tokens(x: jax.Array, start: int, stop: int) -> jax.Array:
  """Tokens [start, stop) of `x: [B, N, ...]`; those outside [0, N) are zeros."""
  left, right = max(0, -start), max(0, stop - x.shape[1])
  padded = jnp.pad(x, [(0, 0), (left, right)] + [(0, 0)] * (x.ndim - 2))
  return padded[:, start + left : stop + left]


def check_sliced(
  kind_name: str,
  kind: Kind,
  implementation: str,
  *,
  b: int,
  n: int,
  queries: tuple[int, int],
  keys: tuple[int, int],
  mask: dict,
  traced: bool = False,
  dtype=jnp.float32,
  blocks: ops.BlockSizes | None = None,
  seed: int = 0,
) -> None:
  """A sequence shard, as `iha_jax.parallel.context` calls an implementation: the queries
  are tokens `queries` = [q0, q1) of an n-token sequence, the keys and values tokens
  `keys` = [k0, k1) (those outside the sequence are padding, segment 0), with their own
  segment ids and positions and `query_offset = q0 - k0` (a traced scalar under jit when
  `traced`). `implementation` (the registry entry itself: the public entry points take
  keys of the queries' length only) against "reference" on the same call, output and
  every input's gradient (`check`'s tolerances)."""
  key, ct_key = jax.random.split(jax.random.key(seed))
  full = tuple(x.astype(dtype) for x in kind.make(key, b, n))
  opts = options(kind, b, n, **mask)
  segment_ids = opts.pop("segment_ids", jnp.ones((b, n), jnp.int32))
  positions = opts.pop("positions", jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))
  low = (_tokens(full[0], *queries), *(_tokens(x, *keys) for x in full[1:3]), *full[3:])
  exact = tuple(x.astype(jnp.float32) for x in low)
  sliced = ops.AttentionOptions(
    **opts,
    segment_ids=_tokens(segment_ids, *queries),
    positions=_tokens(positions, *queries),
    kv_segment_ids=_tokens(segment_ids, *keys),
    kv_positions=_tokens(positions, *keys),
    block_sizes=blocks,
  )
  offset = queries[0] - keys[0]

  def run(name: str, query_offset, *arrays):
    call_options = sliced.replace(query_offset=query_offset, implementation=name)
    return registry.lookup(kind_name, name)(*arrays, call_options)

  ref = jax.jit(functools.partial(run, "reference", offset))
  if traced:
    fast = lambda *a: jax.jit(functools.partial(run, implementation))(jnp.int32(offset), *a)
  else:
    fast = jax.jit(functools.partial(run, implementation, offset))
  cotangent = jax.random.normal(ct_key, jax.eval_shape(ref, *exact).shape)
  want = value_and_grads(ref, exact, cotangent)
  interpret = pltpu.force_tpu_interpret_mode() if implementation.startswith("pallas_tpu") else None
  with interpret or contextlib.nullcontext():
    got = value_and_grads(fast, low, cotangent)
  assert_close(got[0], want[0], dtype, f"{implementation} sliced out")
  assert_close(got[1], want[1], dtype, f"{implementation} sliced grads")
