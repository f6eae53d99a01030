"""Fused Pallas kernels against the dense reference, in interpret mode on CPU, through
the shared harness (tests/conformance.py); then what the kernels save and lower to, and
the kernels under shard_map.

GPU (Triton) kernels run through the public dispatcher: off-GPU they lower to Pallas'
interpreter automatically. TPU (Mosaic) kernels run under
`pltpu.force_tpu_interpret_mode()`, which models Mosaic semantics (SMEM, VMEM scratch,
grid order). Every case checks the forward and every gradient (q, k, v, alpha_*,
collapse) with a random cotangent, with packed segments, padding tokens and a sequence
that does not divide the tiles; causal and bidirectional cases, and MHA with a value
wider than q/k. Sequence shards (queries at an offset into longer keys, as context
parallelism calls the kernels) are checked against the reference the same way, and the
tile-band arithmetic at any offset against brute force.
"""

from __future__ import annotations

import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax.core.masking import visible
from iha_jax.kernels import common, fused
from iha_jax.kernels.sharded import sharded_iha_attention
from iha_jax.ops import AttentionOptions, BlockSizes, iha_attention, resolve_implementation
from iha_jax.parallel import targets
from tests import conformance as cf
from tests.utils import assert_close, random_iha_inputs

# Every case: forward and every gradient against the reference (tests/conformance.py),
# row 0 packing two documents and padding, a sequence the tiles do not divide.
CAUSAL, BIDIRECTIONAL = dict(causal=True, packed=True), dict(causal=False, packed=True)


def _case(name, kind, implementation, n, mask, *, b=2, dtype=jnp.float32, blocks=None):
  return pytest.param(kind, implementation, b, n, mask, dtype, blocks, id=name)


GPU, TPU = "pallas_gpu", "pallas_tpu"
KERNEL_CASES = [
  # Triton interpret: tiles of 16 virtual rows (GPU tiles count rows, powers of two) over
  # N = 20: 8-token tiles at P = 2 (padded to 24: three tiles each way), 16 at P = 1.
  # P in {1, 2, 4}, global and windowed (with the bfloat16 cases below); G = 1 key/value
  # head (multi-query) at P = 4.
  *[
    _case(
      f"gpu-p{p}-w{w}-g{g or 2}",
      cf.iha(2, 16, p, kv_heads=g),
      GPU,
      20,
      {**CAUSAL, "window": w},
      blocks=BlockSizes(max(16, 8 * p), max(16, 8 * p)),
    )
    for p, w, g in [(1, 13, None), (2, None, None), (4, 13, 1)]
  ],
  # Bidirectional: with a 5-row window on 16-row virtual tiles, a tile sees its neighbours
  # on both sides only (the symmetric band); globally every tile sees every tile.
  *[
    _case(
      f"gpu-bidirectional-w{w}",
      cf.iha(2, 16, 2),
      GPU,
      20,
      {**BIDIRECTIONAL, "window": w},
      blocks=BlockSizes(16, 16),
    )
    for w in [None, 5]
  ],
  *[
    _case(
      f"gpu-bf16-p{p}-w{w}-g{g or 2}",
      cf.iha(2, 16, p, kv_heads=g),
      GPU,
      20,
      {**CAUSAL, "window": w},
      dtype=jnp.bfloat16,
      blocks=BlockSizes(8 * p, 8 * p),
    )
    for p, w, g in [(2, 13, None), (4, None, 1)]
  ],
  # d = 15 is padded per lane half to the kernels' power-of-two width; default tiles.
  # P = 3: each token owns 4 rows of a GPU tile, the 4th dead (segment 0).
  _case(
    "gpu-per-head-no-rope-d15",
    cf.iha(3, 15, 3, per_head=True, rope_theta=None),
    GPU,
    24,
    {**CAUSAL, "window": None},
    b=1,
  ),
  # P = H = 20 (the paper's default): GPU tiles of 128 rows hold 4 tokens of 32 rows
  # (12 dead), five tiles each way. TPU: P = 5 > H = 3 (P not a power of two): 100 virtual
  # rows in 32-row tiles, a token's pseudo-heads straddling tiles (P = 20 is checked by
  # the TPU compiler in tests/test_compile_targets.py).
  _case(
    "gpu-p20-h20",
    cf.iha(20, 16, 20),
    GPU,
    20,
    {**CAUSAL, "window": 150},
    b=1,
    blocks=BlockSizes(128, 128),
  ),
  _case(
    "tpu-p5-h3", cf.iha(3, 16, 5), TPU, 20, {**CAUSAL, "window": 40}, blocks=BlockSizes(32, 32)
  ),
  # Mosaic interpret: N = 136 at P = 2 is 272 virtual rows: five 64-row query tiles and
  # two 256-row key tiles (padded to 320 and 512). Bidirectional window 100: the bands
  # differ per tile and the last key tile is mostly padding; row 1 is one document across
  # both key tiles. The causal case has one key/value head for both query heads (G = 1).
  *[
    _case(
      f"tpu-multi-tile-{name}",
      cf.iha(2, 16, 2, kv_heads=g),
      TPU,
      136,
      {**mask, "window": 100},
      blocks=BlockSizes(64, 256),
    )
    for name, mask, g in [("causal-g1", CAUSAL, 1), ("bidirectional", BIDIRECTIONAL, None)]
  ],
  _case("tpu-p4-w9-g1", cf.iha(2, 16, 4, kv_heads=1), TPU, 20, {**CAUSAL, "window": 9}),
  _case("tpu-bf16-p2", cf.iha(2, 16, 2), TPU, 20, {**CAUSAL, "window": None}, dtype=jnp.bfloat16),
  # MHA (P = 1 through the same kernels), v twice as wide as q/k (differential
  # attention's MHA call): dq, dk `[.., d]`, dv `[.., 2d]`; grouped-query: G = 1 key/value
  # head for H = 3 (GPU), G = 2 for H = 4 (TPU: dk/dv blocks resident over each group).
  _case(
    "mha-gpu-causal-g1",
    cf.mha(3, 16, 32, kv_heads=1),
    GPU,
    20,
    {**CAUSAL, "window": 5},
    blocks=BlockSizes(16, 16),
  ),
  _case(
    "mha-tpu-bidirectional-g2",
    cf.mha(4, 16, 32, kv_heads=2),
    TPU,
    20,
    {**BIDIRECTIONAL, "window": 5},
  ),
]


@pytest.mark.parametrize("kind, implementation, b, n, mask, dtype, blocks", KERNEL_CASES)
def test_kernels_match_reference(kind, implementation, b, n, mask, dtype, blocks):
  cf.check(kind, implementation, b=b, n=n, mask=mask, dtype=dtype, blocks=blocks)


# Sequence shards (`iha_jax.parallel.context`): queries [q0, q1) of a 40-token sequence
# (row 0: two documents, then padding from token 30) against keys [k0, k1) with their own
# ids and positions, query offset q0 - k0. Tiles of 8 tokens: the offset shifts the band
# off the tile grid.
def _shard(name, kind_name, kind, implementation, *, queries, keys, mask, blocks, traced=False):
  return pytest.param(kind_name, kind, implementation, queries, keys, mask, blocks, traced, id=name)


SLICED_CASES = [
  # A window layer's shard and its halo, ceil((13 - 1) / 2) = 6 tokens (a static offset).
  _shard(
    "tpu-window-halo-g1",
    "iha",
    cf.iha(2, 16, 2, kv_heads=1),
    TPU,
    queries=(16, 32),
    keys=(10, 32),
    mask={**CAUSAL, "window": 13},
    blocks=BlockSizes(16, 16),
  ),
  # A global layer's shard (every key) at an offset traced under jit; MHA, G = 2 for H = 4.
  _shard(
    "tpu-mha-global-traced-g2",
    "mha",
    cf.mha(4, 16, 32, kv_heads=2),
    TPU,
    queries=(20, 36),
    keys=(0, 40),
    mask={**CAUSAL, "window": None},
    blocks=BlockSizes(16, 16),
    traced=True,
  ),
  # Bidirectional window at P = 4 (halo ceil(8 / 4) = 2 tokens each side) on the last shard:
  # keys past the sequence end are padding (row 0's queries all are); one key/value head.
  _shard(
    "gpu-bidirectional-halo-g1",
    "iha",
    cf.iha(2, 16, 4, kv_heads=1),
    GPU,
    queries=(32, 40),
    keys=(30, 42),
    mask={**BIDIRECTIONAL, "window": 9},
    blocks=BlockSizes(32, 32),
  ),
]


@pytest.mark.parametrize(
  "kind_name, kind, implementation, queries, keys, mask, blocks, traced", SLICED_CASES
)
def test_kernels_match_reference_on_sequence_shards(
  kind_name, kind, implementation, queries, keys, mask, blocks, traced
):
  shard = dict(queries=queries, keys=keys, mask=mask, traced=traced, blocks=blocks)
  cf.check_sliced(kind_name, kind, implementation, b=2, n=40, **shard)


def test_tile_bands_with_query_offsets():
  """The GPU kernels' `kv_range` / `q_range` at any query offset visit exactly the tiles
  holding a visible (query, key) pair: causal and bidirectional, global and window, P in
  {1, 3} (the TPU schedules: tests/test_tile_schedule.py)."""
  for causal, window, p in [(True, None, 1), (True, 7, 3), (False, 5, 3), (False, None, 1)]:
    base = common.Config(
      num_heads=1,
      num_kv_heads=1,
      num_targets=1,
      kv_targets=1,
      num_pseudo=p,
      mixing=p > 1,
      head_dim=8,
      half=4,
      value_half=4,
      block_q=8,
      block_k=16,
      seq_len=24,
      window=window,
      rope=False,
      causal=causal,
      sliced=True,
      kv_seq_len=48,
      static_offset=None,
    )
    q_rows, k_rows = np.arange(24 * p), np.arange(48 * p)
    for offset in range(-30, 60, 3):
      seen = visible((offset * p + q_rows)[:, None], k_rows[None, :], None, None, window, causal)
      tiles = seen.reshape(3, 8 * p, 3, 16 * p).any(axis=(1, 3))  # [query tile, key tile]
      every = np.arange(3)
      for ranges, needed in [
        (common.kv_range(every, base, offset, np), tiles),
        (common.q_range(every, base, offset, np), tiles.T),
      ]:
        for (lo, hi), row in zip(zip(*ranges), needed):
          want = np.flatnonzero(row)
          got = np.arange(lo, hi)
          np.testing.assert_array_equal(got, want, err_msg=f"{causal} {window} {p} {offset}")


def test_block_sizes_are_checked():
  args = random_iha_inputs(jax.random.key(0), 1, 16, 2, 16, 4)
  # TPU tiles are multiples of 16 rows (virtual tokens), the bf16 sublane packing.
  with pytest.raises(ValueError, match="block_sizes.block_q=30: TPU tiles"):
    iha_attention(*args, implementation="pallas_tpu", block_sizes=BlockSizes(30, 32))
  with pytest.raises(ValueError, match="block_sizes.block_k=8: TPU tiles"):
    iha_attention(*args, implementation="pallas_tpu", block_sizes=BlockSizes(16, 8))
  # GPU tiles are powers of two of at least 16 rows and at least one token's Pr rows.
  with pytest.raises(ValueError, match="power-of-two"):
    iha_attention(*args, implementation="pallas_gpu", block_sizes=BlockSizes(24, 16))
  with pytest.raises(ValueError, match="power-of-two"):
    iha_attention(*args, implementation="pallas_gpu", block_sizes=BlockSizes(8, 16))


def test_auto_is_xla_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip(f"backend is {jax.default_backend()}, not cpu")
  assert resolve_implementation("auto") == "xla"


# --- No P-sized pseudo q/k/v anywhere. ------------------------------------------------------
B, N, H, D, P = 1, 20, 2, 16, 2


def _grad_fn(implementation):
  # 16-row GPU tiles: interpreted on CPU, a kernel's tiles appear in the program as arrays
  # ([rows, lanes]), which must stay below the whole-sequence size the check looks for.
  blocks = BlockSizes(16, 16) if implementation == "pallas_gpu" else None

  def loss(*args):
    out = iha_attention(*args, window=13, implementation=implementation, block_sizes=blocks)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return jax.grad(loss, argnums=tuple(range(7)))


def _virtual_axis_shapes(shapes):
  """Shapes holding a virtual-sequence axis (N*P or a padded N*P) of >= P-sized arrays."""
  virtual = {N * P, 24 * P, 32 * P}  # N and the kernels' padded token counts, times P
  big = B * N * H * D * P
  return [s for s in shapes if np.prod(s) >= big and virtual & set(s)]


def _residual_shapes(implementation, capsys):
  args = random_iha_inputs(jax.random.key(0), B, N, H, D, P)
  f = lambda *a: iha_attention(*a, window=13, implementation=implementation)
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(f, *args)
  text = capsys.readouterr().out
  return [
    tuple(int(x) for x in dims.split(",") if x)
    for dims in re.findall(r"\b(?:f32|bf16|i32)\[([\d,]*)\]", text)
  ]


def test_saved_residuals_hold_nothing_p_sized(capsys):
  shapes = _residual_shapes("pallas_gpu", capsys)
  assert not _virtual_axis_shapes(shapes), shapes
  # The output o [B, H, P, Np, W] (Np = 32, W = 32) is recomputed in the backward, so
  # the largest residuals are the source q/k/v in kernel layout [B, H, Np, W]: 1/P of o.
  source = (B, H, 32, 32)
  assert max(np.prod(s) for s in shapes) == np.prod(source), shapes
  assert sum(np.prod(s) for s in shapes if np.prod(s) == np.prod(source)) == 3 * np.prod(source)
  # The check can fail: the materialised XLA path saves virtual-sequence arrays.
  assert _virtual_axis_shapes(_residual_shapes("xla", capsys))


def _lowered_shapes(implementation, platform):
  """Shapes of the float arrays of the lowered gradient program (pseudo q/k/v would be
  float; on CPU the interpreted kernels' gathers add int32 index arrays of tile size)."""
  args = random_iha_inputs(jax.random.key(0), B, N, H, D, P)
  with targets.lowering_for(platform):
    lowered = jax.jit(_grad_fn(implementation)).trace(*args).lower(lowering_platforms=(platform,))
  text = lowered.as_text()
  return [
    tuple(int(x) for x in dims.split("x")[:-1])
    for dims in re.findall(r"tensor<([\dx]+x(?:f32|bf16))>", text)
  ]


@pytest.mark.parametrize("implementation, platform", [(GPU, "cuda"), (GPU, "cpu")])
def test_lowered_gradient_program_has_no_pseudo_qkv(implementation, platform):
  assert not _virtual_axis_shapes(_lowered_shapes(implementation, platform))


def test_tpu_saves_only_the_pseudo_output(capsys):
  """On TPU pseudo q/k/v are made by einsums (in the forward and again in the backward),
  never saved: of the residuals only the pseudo output o is P-sized."""
  shapes = _residual_shapes("pallas_tpu", capsys)
  virtual = _virtual_axis_shapes(shapes)
  assert len(virtual) == 1, shapes  # o [B, H, N * P (padded), d]
  assert np.prod(virtual[0]) <= B * H * 32 * P * D


def test_lowered_scan_flags_materialised_path():
  assert _virtual_axis_shapes(_lowered_shapes("xla", "cpu"))


# --- shard_map over 8 fake CPU devices. ------------------------------------------------------
@pytest.mark.parametrize(
  "per_head, axis_type, causal, kv_heads",
  [(False, "explicit", True, 2), (True, "auto", False, None)],
)
def test_sharded_kernels_match_reference(per_head, axis_type, causal, kv_heads):
  """Batch over 'data', heads over 'tensor' (grouped-query: G = 2 key/value heads for
  H = 4, one per tensor shard with its two query heads)."""
  axis_types = (
    jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto,
  ) * 2
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=axis_types)
  b, n, h, d, p = 4, 16, 4, 16, 2
  args = random_iha_inputs(jax.random.key(5), b, n, h, d, p, per_head=per_head, kv_heads=kv_heads)
  cotangent = jax.random.normal(jax.random.key(6), (b, n, h, d))

  def loss(sharded, *a):
    if sharded:
      out = sharded_iha_attention(*a, mesh=mesh, window=9, causal=causal, platform="gpu")
    else:
      out = iha_attention(*a, window=9, causal=causal, implementation="reference")
    return jnp.sum(out * cotangent)

  got = jax.jit(jax.value_and_grad(lambda *a: loss(True, *a), argnums=tuple(range(7))))(*args)
  want = jax.value_and_grad(lambda *a: loss(False, *a), argnums=tuple(range(7)))(*args)
  assert_close(got, want, jnp.float32)


def test_pseudo_outputs_layout():
  args = random_iha_inputs(jax.random.key(7), 1, 20, 2, 16, 2)
  seg = jnp.ones((1, 20), jnp.int32)
  pos = jnp.arange(20, dtype=jnp.int32)[None]
  options = AttentionOptions(segment_ids=seg, positions=pos)
  o, restore = fused.pseudo_outputs(*args[:3], args[3:6], options, platform="gpu")
  assert o.shape == (1, 2, 32, 2, 32)  # GPU: [B, H, Np, Pr, W]
  assert restore(jnp.zeros((1, 32, 5, 32))).shape == (1, 20, 5, 16)
