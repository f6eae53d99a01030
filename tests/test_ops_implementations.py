"""Every non-reference implementation equals "reference": forward and all gradients."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax import ops
from tests.utils import assert_close, packed_positions, packed_segments, random_iha_inputs

B, N, D = 2, 7, 8  # N = 7 is a multiple of no block size below
BLOCKS = ops.BlockSizes(block_q=4, block_k=4)  # several tiles even at tiny T

MASK_CASES = {
    "global": dict(window=None),
    "window_small": dict(window=3),
    "window_large": dict(window=1000),  # larger than T: must equal global
    "packed_padding": dict(window=None, packed=True),
    "window_packed": dict(window=5, packed=True),
    "positions": dict(window=None, positions=True),
}


def _mask_kwargs(case: str, seed: int) -> dict:
  spec = dict(MASK_CASES[case])
  kwargs = {"window": spec.pop("window")}
  if spec.get("packed"):
    kwargs["segment_ids"] = packed_segments(B, N)
    kwargs["positions"] = packed_positions(kwargs["segment_ids"])
  if spec.get("positions"):
    rng = np.random.default_rng(seed)
    kwargs["positions"] = jnp.asarray(rng.integers(0, 4 * N, (B, N)), jnp.int32)
  return kwargs


def _loss_and_grads(fn, args, cotangent):
  def loss(*a):
    return jnp.sum(fn(*a).astype(jnp.float32) * cotangent)
  out = fn(*args)
  grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
  return out, grads


# float32 over the full grid; bfloat16 (same code path, looser tolerance) on a
# cross-section of it, to keep the CPU suite fast.
GRID = [(p, h, case, jnp.float32) for p in (1, 2, 3) for h in (1, 2, 4)
        for case in sorted(MASK_CASES)]
GRID += [(p, h, case, jnp.bfloat16) for p, h in ((1, 2), (2, 4), (3, 1))
         for case in sorted(MASK_CASES)]


@pytest.mark.parametrize("p, h, case, dtype", GRID,
                         ids=[f"P{p}-H{h}-{c}-{jnp.dtype(t).name}" for p, h, c, t in GRID])
def test_iha_xla_matches_reference(p, h, case, dtype):
  seed = 100 * p + 10 * h + sorted(MASK_CASES).index(case)
  key, ct_key = jax.random.split(jax.random.PRNGKey(seed))
  args = random_iha_inputs(key, B, N, h, D, p, per_head=(case == "positions"))
  cotangent = jax.random.normal(ct_key, (B, N, h, D))
  kwargs = _mask_kwargs(case, seed)

  ref = lambda *a: ops.iha_attention(*a, implementation="reference", **kwargs)
  xla = lambda *a: ops.iha_attention(*a, implementation="xla", block_sizes=BLOCKS, **kwargs)
  low = tuple(a.astype(dtype) for a in args)
  # The oracle sees the same (rounded) values, in float32 at highest precision.
  exact = tuple(a.astype(jnp.float32) for a in low)
  want_out, want_grads = _loss_and_grads(jax.jit(ref), exact, cotangent)
  got_out, got_grads = _loss_and_grads(jax.jit(xla), low, cotangent)

  chex.assert_shape(got_out, (B, N, h, D))
  chex.assert_type(got_out, dtype)
  assert_close(got_out, want_out, dtype, "out")
  names = ("dq", "dk", "dv", "dalpha_q", "dalpha_k", "dalpha_v", "dcollapse")
  for name, got, want in zip(names, got_grads, want_grads):
    chex.assert_type(got, dtype)
    assert_close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["global", "window_small", "packed_padding"])
def test_mha_xla_matches_reference(case, dtype):
  h = 3
  key, ct_key = jax.random.split(jax.random.PRNGKey(len(case)))
  q, k, v, *_ = random_iha_inputs(key, B, N, h, D, 1)
  cotangent = jax.random.normal(ct_key, (B, N, h, D))
  kwargs = _mask_kwargs(case, 0)
  ref = lambda *a: ops.mha_attention(*a, implementation="reference", **kwargs)
  xla = lambda *a: ops.mha_attention(*a, implementation="xla", block_sizes=BLOCKS, **kwargs)
  low = tuple(x.astype(dtype) for x in (q, k, v))
  want_out, want_grads = _loss_and_grads(
      jax.jit(ref), tuple(x.astype(jnp.float32) for x in low), cotangent)
  got_out, got_grads = _loss_and_grads(jax.jit(xla), low, cotangent)
  assert_close(got_out, want_out, dtype, "out")
  assert_close(got_grads, want_grads, dtype, "grads")


@pytest.mark.parametrize("blocks", [None, ops.BlockSizes(8, 4), ops.BlockSizes(4, 16)],
                         ids=["default", "bq8_bk4", "bq4_bk16"])
def test_xla_block_shapes_agree(blocks):
  """Unequal, default and larger-than-T tiles all give the reference answer."""
  p, h = 3, 2
  args = random_iha_inputs(jax.random.PRNGKey(1), B, 11, h, D, p)
  cotangent = jax.random.normal(jax.random.PRNGKey(2), (B, 11, h, D))
  for window in (None, 4):
    want = _loss_and_grads(
        jax.jit(lambda *a: ops.iha_attention(*a, window=window, implementation="reference")),
        args, cotangent)
    got = _loss_and_grads(
        jax.jit(lambda *a: ops.iha_attention(*a, window=window, implementation="xla",
                                              block_sizes=blocks)), args, cotangent)
    assert_close(got, want, jnp.float32)


class JitAgreementTest(chex.TestCase):
  """jit and eager execution compute the same values."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_iha_jit_and_eager_agree(self):
    args = random_iha_inputs(jax.random.PRNGKey(9), B, N, 2, D, 2)
    segment_ids = packed_segments(B, N)

    @self.variant
    def fn(*a):
      return ops.iha_attention(*a, window=4, segment_ids=segment_ids, implementation="xla",
                               block_sizes=BLOCKS)

    want = ops.iha_attention(*args, window=4, segment_ids=segment_ids,
                             implementation="reference")
    out = fn(*args)
    chex.assert_shape(out, (B, N, 2, D))
    assert_close(out, want, jnp.float32)
