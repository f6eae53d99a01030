"""IHA's on-chip GPU window path ("pallas_gpu_window", `iha_jax.kernels.window.gpu`)
against the dense reference: its Triton kernel in Pallas' interpreter on CPU (the
dispatcher falls back to it off-GPU by itself), forward and every gradient (q, k, v,
alpha_*, collapse) with a random cotangent, through the shared harness
(tests/conformance.py); its backward's own kernels, programs of several tiles included,
never the materialised pipeline. Then its tiling and the calls it refuses in one line.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax.core.masking import visible
from iha_jax.core.options import AttentionOptions
from iha_jax.kernels.flash import attention as flash_attention
from iha_jax.kernels.window import gpu as gpu_window
from iha_jax.kernels.window import gpu_plan
from iha_jax.kernels.window.common import in_band
from iha_jax.ops import BlockSizes, iha_attention
from tests import conformance as cf
from tests.utils import random_iha_inputs

WINDOW = "pallas_gpu_window"
CAUSAL, BIDIRECTIONAL = dict(causal=True, packed=True), dict(causal=False, packed=True)


def _case(name, kind, n, mask, blocks, *, dtype=jnp.float32, full=True):
  marks = (pytest.mark.full,) if full else ()
  return pytest.param(kind, n, mask, BlockSizes(*blocks), dtype, id=name, marks=marks)


# Row 0 packs two documents and padding (tests/conformance.py). 16-row tiles over 20
# tokens: several query tiles and key groups, the last ones part padding tokens, and
# groups whose pseudo rows are padded to a power of two (P = 3, 5: 15 of 16 rows).
CASES = [
  _case("causal-p2-d16", cf.iha(2, 16, 2), 20, {**CAUSAL, "window": 13}, (16, 16), full=False),
  _case("bidirectional-p5", cf.iha(3, 32, 5), 20, {**BIDIRECTIONAL, "window": 23}, (16, 16)),
  # One key/value head for both query heads; key groups of 8 tokens, query tiles of 4.
  _case("gqa-p4-g1", cf.iha(2, 32, 4, kv_heads=1), 20, {**CAUSAL, "window": 13}, (16, 32)),
  _case(
    "per-head-no-rope-p3",
    cf.iha(4, 16, 3, per_head=True, rope_theta=None, kv_heads=2),
    20,
    {**CAUSAL, "window": 11},
    (16, 16),
  ),
  # P = 9 > 16 / 2: query tiles and key groups of one token each, the case of the paper's
  # P = H = 20 (whose weight partials fold without 0/1 token selections).
  _case(
    "one-token-groups-p9", cf.iha(2, 16, 9), 20, {**CAUSAL, "window": 13}, (16, 16), full=False
  ),
  _case(
    "bf16-g1",
    cf.iha(4, 32, 2, kv_heads=1),
    20,
    {**CAUSAL, "window": 13},
    (16, 16),
    dtype=jnp.bfloat16,
  ),
]


@pytest.mark.parametrize("kind, n, mask, blocks, dtype", CASES)
def test_gpu_window_matches_reference(kind, n, mask, blocks, dtype):
  cf.check(kind, WINDOW, b=2, n=n, mask=mask, dtype=dtype, blocks=blocks)


@pytest.mark.full
def test_gpu_window_matches_reference_on_a_sequence_shard():
  """A window layer's shard and its halo (a static query offset): queries [16, 32) of 40
  tokens against keys [10, 32), one key/value head."""
  cf.check_sliced(
    "iha",
    cf.iha(2, 16, 2, kv_heads=1),
    WINDOW,
    b=2,
    n=40,
    queries=(16, 32),
    keys=(10, 32),
    mask={**CAUSAL, "window": 13},
    blocks=BlockSizes(16, 16),
  )


def test_gpu_window_backward_stays_on_chip(monkeypatch):
  """The gradient runs the path's own kernels (forward; the backward's statistics, dQ and
  dK/dV), never the materialised
  pipeline (its mixing einsums in HBM and the flash kernels)."""

  def materialised(*args, **kwargs):
    raise AssertionError("the backward called the materialised pipeline")

  monkeypatch.setattr(flash_attention, "iha", materialised)
  q, k, v, *mixing = random_iha_inputs(jax.random.key(0), 1, 12, 2, 16, 2)
  attend = lambda *x: iha_attention(
    *x, window=8, block_sizes=BlockSizes(16, 16), implementation=WINDOW
  ).sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(attend, argnums=tuple(range(7))))(q, k, v, *mixing))
  kernels = set(re.findall(r"name=(iha_\w+)", jaxpr))
  assert kernels == {
    "iha_gpu_window_forward",
    "iha_gpu_window_stats",
    "iha_gpu_window_dq",
    "iha_gpu_window_dkv",
  }


@pytest.mark.full
@pytest.mark.parametrize("kind, n, mask, blocks, dtype", [CASES[1], CASES[2]])
def test_gpu_window_backward_programs_of_several_tiles(monkeypatch, kind, n, mask, blocks, dtype):
  """Two backward programs per batch row: each takes several query tiles (key groups),
  the last ones padding tiles, and sums its tiles' partials of the mixing and collapse."""
  monkeypatch.setattr(gpu_plan, "PROGRAMS", 2)
  cf.check(kind, WINDOW, b=2, n=n, mask=mask, dtype=dtype, blocks=blocks)


def _plan(h: int, g: int, p: int, window: int, **options) -> gpu_plan.Plan:
  q = jax.ShapeDtypeStruct((1, 2048, h, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2048, g, 128), jnp.bfloat16)
  alphas = tuple(jax.ShapeDtypeStruct((x, x, p), jnp.float32) for x in (h, g, g))
  collapse = jax.ShapeDtypeStruct((h, h, p), jnp.float32)
  return gpu_window.plan_for(q, k, alphas, collapse, AttentionOptions(window=window, **options))


def test_gpu_window_tiles_fill_their_power_of_two_rows():
  """The paper's layer (H = P = 20): 3 tokens fill 60 of a 64-row query tile; key groups
  of one token (20 of 32 rows: 64-row groups exceed the register budget). At P = 4,
  32-row query tiles (a 64-row one's 320 source rows exceed the budget) and 16-row key
  groups of 4 tokens (80 source rows, padded to 128)."""
  paper = _plan(20, 20, 20, 204)
  assert (paper.q_tokens, paper.q_rows, paper.q_src, paper.out_rows) == (3, 64, 64, 64)
  assert (paper.k_tokens, paper.k_rows, paper.k_src) == (1, 32, 32)
  p4 = _plan(20, 20, 4, 1024)
  assert (p4.q_tokens, p4.q_rows, p4.q_src, p4.out_rows) == (8, 32, 256, 256)
  assert (p4.k_tokens, p4.k_rows, p4.k_src) == (4, 16, 128)


def test_gpu_window_refuses_in_one_line_naming_the_limit():
  q, k, v, *mixing = random_iha_inputs(jax.random.key(0), 1, 8, 2, 16, 2)
  assert "sliding windows only" in gpu_window.unsupported(q, v, 2, AttentionOptions())
  assert gpu_window.unsupported(q, v, 2, AttentionOptions(window=8)) is None
  with pytest.raises(gpu_plan.GpuUnsupportedShape) as error:
    iha_attention(q, k, v, *mixing, window=None, implementation=WINDOW)
  message = str(error.value)
  assert "\n" not in message and "'pallas_gpu'" in message and WINDOW in message
  with pytest.raises(gpu_plan.GpuUnsupportedShape, match="block_sizes.block_q=24"):
    iha_attention(q, k, v, *mixing, window=8, block_sizes=BlockSizes(24, 16), implementation=WINDOW)


@pytest.mark.parametrize("causal", [True, False])
def test_window_band_is_the_masking_rule(causal):
  """The window paths' band (`window.common.in_band`: the TPU score tiles' bias, the GPU
  kernels' masks) is `core.masking.visible`'s rule; the GPU tiling's key groups of a query
  tile, and query tiles of a key group, hold every pair that rule makes visible (shards
  at a query offset included)."""
  delta = np.arange(-50, 51)
  for window in (1, 4, 13, 50):
    want = np.asarray(visible(delta, np.zeros_like(delta), None, None, window, causal))
    assert (in_band(delta, window, causal) == want).all(), window
  for p, window, offset in itertools.product((3, 5), range(1, 40), (0, 7)):
    n = 20
    q = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((1, n + offset, 2, 16), jnp.float32)
    alphas = tuple(jax.ShapeDtypeStruct((2, 2, p), jnp.float32) for _ in range(3))
    collapse = jax.ShapeDtypeStruct((2, 2, p), jnp.float32)
    blocks = BlockSizes(16, 16)  # tiles and groups of a few tokens
    options = AttentionOptions(
      window=window, causal=causal, query_offset=offset, block_sizes=blocks
    )
    plan = gpu_window.plan_for(q, k, alphas, collapse, options)
    t = (offset + np.arange(n)[:, None]) * p + np.arange(p)  # [N, P]: virtual query rows
    s = np.arange(n + offset)[:, None] * p + np.arange(p)
    seen = np.asarray(visible(t.reshape(-1, 1), s.reshape(1, -1), None, None, window, causal))
    seen = seen.reshape(n, p, n + offset, p).any(axis=(1, 3))  # [query token, key token]
    tile, group = np.arange(n) // plan.q_tokens, np.arange(n + offset) // plan.k_tokens
    groups = np.array([gpu_plan.key_groups(plan, i) for i in range(plan.num_q)])
    tiles = np.array([gpu_plan.query_tiles(plan, j) for j in range(plan.num_k)])
    for bands, home, other in ((groups, tile, group), (tiles, group, tile)):
      lo, hi = bands[home, 0], bands[home, 1]
      pairs = seen if bands is groups else seen.T
      inside = (lo[:, None] <= other[None, :]) & (other[None, :] < hi[:, None])
      assert (inside | ~pairs).all(), (p, window, offset)
