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
from jax.experimental.pallas import tpu as pltpu

from iha_jax.kernels.flash import attention as flash_attention
from iha_jax.kernels.sharded import sharded_iha_attention
from iha_jax.kinds import registry
from iha_jax.models.config import TransformerConfig
from iha_jax.models.functional_lm import FunctionalTransformerLM
from iha_jax.ops import BlockSizes, iha_attention
from tests import conformance as cf
from tests.utils import assert_close, random_iha_inputs

# Every case: forward and every gradient against the reference (tests/conformance.py),
# row 0 packing two documents and padding, a sequence the tiles do not divide.
CAUSAL, BIDIRECTIONAL = dict(causal=True, packed=True), dict(causal=False, packed=True)


# `make test` runs one case per implementation and mask class (and those that kill a mutant
# of tests/mutants.py); the cases in FULL_CASES run in `make test-all`.
FULL_CASES = {
  "gpu-p1-w13-g2",
  "gpu-p2-wNone-g2",
  "gpu-bidirectional-wNone",
  "gpu-bf16-p2-w13-g2",
  "gpu-bf16-p4-wNone-g1",
  "gpu-p20-h20",
  "tpu-p5-h3",
  "tpu-multi-tile-causal-g1",
  "tpu-dq-ring-g1",
  "tpu-halves-ring-g1",
  "tpu-bf16-p2",
  "tpu-window-p4-g1",
  "tpu-window-per-head-no-rope",
  "tpu-window-bf16-g1",
  "tpu-window-halo-g1",
  "tpu-window-bidirectional-p5",
  "mha-tpu-bidirectional-g2",
  "tpu-mha-global-traced-g2",
  "gpu-bidirectional-halo-g1",
  "tpu-halves-global",
}


def _full(name: str) -> tuple:
  return (pytest.mark.full,) if name in FULL_CASES else ()


def _case(name, kind, implementation, n, mask, *, b=2, dtype=jnp.float32, blocks=None):
  return pytest.param(kind, implementation, b, n, mask, dtype, blocks, id=name, marks=_full(name))


GPU, TPU, WINDOW = "pallas_gpu", "pallas_tpu", "pallas_tpu_window"
KERNEL_CASES = [
  # Triton interpret: tiles of 16 or 32 virtual rows (powers of two) over N = 20 tokens,
  # i.e. 20 P virtual rows the tiles do not divide (40 rows at P = 2: three 16-row tiles).
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
  # d = 15 is padded to the kernels' power-of-two width (16 lanes); default tiles; P = 3:
  # a token's pseudo-heads straddle tiles.
  _case(
    "gpu-per-head-no-rope-d15",
    cf.iha(3, 15, 3, per_head=True, rope_theta=None),
    GPU,
    24,
    {**CAUSAL, "window": None},
    b=1,
  ),
  # P = H = 20 (the paper's default): 400 virtual rows in 128-row GPU tiles (padded to
  # 512). TPU: P = 5 > H = 3 (P not a power of two): 100 virtual rows in 32-row tiles, a
  # token's pseudo-heads straddling tiles (P = 20 is checked by the TPU compiler in
  # tests/kernels/test_compile_targets.py).
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
  # A causal window on equal tiles: dQ rides in the dK/dV kernel (a ring of query-tile
  # accumulators, `flash.tpu.dq_ring`): nine 32-row tiles, five in flight per key tile,
  # both query heads of the one key/value head sharing the kernel.
  _case(
    "tpu-dq-ring-g1",
    cf.iha(2, 16, 2, kv_heads=1),
    TPU,
    136,
    {**CAUSAL, "window": 100},
    blocks=BlockSizes(32, 32),
  ),
  # 256-row tiles: partly visible pairs run in halves (`flash.tpu_kernel._masked_blocks`, dQ and
  # dK/dV): a causal window's band with the dQ ring and packed documents; a global causal
  # band (folded rows) without documents, its last key tile mostly padding (600 of 768).
  _case(
    "tpu-halves-ring-g1",
    cf.iha(2, 16, 2, kv_heads=1),
    TPU,
    400,
    {**CAUSAL, "window": 300},
    blocks=BlockSizes(256, 256),
  ),
  _case(
    "tpu-halves-global",
    cf.iha(2, 16, 2),
    TPU,
    300,
    {"causal": True, "window": None},
    b=1,
    blocks=BlockSizes(256, 256),
  ),
  _case("tpu-bf16-p2", cf.iha(2, 16, 2), TPU, 20, {**CAUSAL, "window": None}, dtype=jnp.bfloat16),
  # The on-chip window path (pseudo-heads made and collapsed in VMEM): grid tiles of 24
  # tokens (48 rows at P = 2) and 16-row score tiles, so 40 tokens are two tiles, each
  # with three halo blocks before it (a score tile's 128 key rows) and three score tiles
  # per head (H = G: each writes the key rows no earlier one saw, two heads share each
  # mixing product); one key/value head at P = 4; bidirectional at P = 5 > H = 3 (halo
  # blocks on both sides, two score tiles per head); per-head collapse without RoPE.
  *[
    _case(f"tpu-window-{name}", kind, WINDOW, 40, mask, dtype=dtype, blocks=BlockSizes(*blocks))
    for name, kind, mask, blocks, dtype in [
      ("p2-packed", cf.iha(2, 16, 2), {**CAUSAL, "window": 13}, (48, 16), jnp.float32),
      ("p4-g1", cf.iha(2, 16, 4, kv_heads=1), {**CAUSAL, "window": 13}, (32, 16), jnp.float32),
      (
        "bidirectional-p5",
        cf.iha(3, 16, 5),
        {**BIDIRECTIONAL, "window": 40},
        (80, 40),
        jnp.float32,
      ),
      (
        "per-head-no-rope",
        cf.iha(4, 16, 3, per_head=True, rope_theta=None, kv_heads=2),
        {**CAUSAL, "window": 11},
        (48, 24),
        jnp.float32,
      ),
      # bfloat16 with G = 1 of H = 4: the key/value side's token groups (16 tokens) differ
      # from the query side's (8).
      ("bf16-g1", cf.iha(4, 16, 2, kv_heads=1), {**CAUSAL, "window": 13}, (32, 16), jnp.bfloat16),
    ]
  ],
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
  return pytest.param(
    kind_name, kind, implementation, queries, keys, mask, blocks, traced, id=name, marks=_full(name)
  )


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
  # The same shard through the on-chip window path (keys padded to its tiles in front).
  _shard(
    "tpu-window-onchip-halo-g1",
    "iha",
    cf.iha(2, 16, 2, kv_heads=1),
    WINDOW,
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


assert FULL_CASES <= {c.id for c in KERNEL_CASES + SLICED_CASES}, "FULL_CASES names a lost case"


@pytest.mark.parametrize(
  "kind_name, kind, implementation, queries, keys, mask, blocks, traced", SLICED_CASES
)
def test_kernels_match_reference_on_sequence_shards(
  kind_name, kind, implementation, queries, keys, mask, blocks, traced
):
  shard = dict(queries=queries, keys=keys, mask=mask, traced=traced, blocks=blocks)
  cf.check_sliced(kind_name, kind, implementation, b=2, n=40, **shard)


@pytest.mark.full
def test_pipeline_in_batch_chunks_matches_reference(monkeypatch):
  """Past `CHUNK_BYTES` of pseudo output a call runs one sequence at a time (what bounds
  the P = 20 step's memory): the same output and gradients, the mixing tensors' summed
  over the chunks."""
  monkeypatch.setattr(flash_attention, "CHUNK_BYTES", 1)
  cf.check(cf.iha(2, 16, 2, kv_heads=1), TPU, b=2, n=20, mask={**CAUSAL, "window": 9})


def test_tpu_forward_alone_matches_reference():
  """Not differentiated, the TPU forward kernel writes no log-sum-exp: the same output."""
  args = random_iha_inputs(jax.random.key(1), 2, 20, 2, 16, 4, kv_heads=1)
  call = lambda impl: iha_attention(*args, window=9, implementation=impl)
  with pltpu.force_tpu_interpret_mode():
    got = jax.jit(lambda: call(TPU))()
  assert_close(got, call("reference"), jnp.float32, "pallas_tpu forward alone")


def test_causal_window_backward_is_one_kernel():
  """The dQ ring is taken where it applies (the case above): no separate dQ kernel."""
  args = random_iha_inputs(jax.random.key(0), 2, 136, 2, 16, 2, kv_heads=1)
  blocks = BlockSizes(32, 32)

  def names(window, causal=True):
    loss = lambda *a: iha_attention(
      *a, window=window, causal=causal, block_sizes=blocks, implementation=TPU
    ).sum()
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
    return set(re.findall(r"iha_flash_[a-z]+", text))

  assert names(100) == {"iha_flash_forward", "iha_flash_dkv"}
  assert names(100, causal=False) == {"iha_flash_forward", "iha_flash_dq", "iha_flash_dkv"}


@pytest.mark.parametrize(
  "policy, saved",
  [("save_attention", True), ("save_attention", False), ("save_projections", False)],
)
def test_remat_saves_small_kernel_residuals(policy, saved, monkeypatch):
  """Under `save_attention` remat the backward reuses the forward kernel's o and lse
  while they are small (no second forward kernel per layer); above
  `SAVED_RESIDUAL_BYTES` (P = 20 at scale), or under `save_projections`, the forward
  reruns instead."""
  if not saved:
    monkeypatch.setattr(flash_attention, "SAVED_RESIDUAL_BYTES", 0)
  cfg = TransformerConfig(
    vocab_size=32, num_layers=2, model_dim=32, num_heads=2, head_dim=16, mlp_dim=32,
    num_pseudo=2, attention_schedule="LM", iha_window=8, implementation=TPU,
  )  # fmt: skip
  if policy == "save_projections":
    monkeypatch.undo()  # small residuals, still not saved
  model = FunctionalTransformerLM(cfg, remat=policy)
  params = model.init(0)
  loss = lambda p: model.apply(p, jnp.ones((1, 16), jnp.int32)).sum()
  names = re.findall(r"iha_flash_[a-z]+", str(jax.make_jaxpr(jax.grad(loss))(params)))
  # Each call is spelt the same number of times; one forward per dK/dV when saved.
  forward, dkv = names.count("iha_flash_forward"), names.count("iha_flash_dkv")
  assert (forward == dkv) if saved else (forward > dkv), (forward, dkv)


def test_block_sizes_are_checked():
  args = random_iha_inputs(jax.random.key(0), 1, 16, 2, 16, 4)
  # TPU tiles are multiples of 16 rows (virtual tokens), the bf16 sublane packing.
  with pytest.raises(ValueError, match="block_sizes.block_q=30: TPU tiles"):
    iha_attention(*args, implementation="pallas_tpu", block_sizes=BlockSizes(30, 32))
  with pytest.raises(ValueError, match="block_sizes.block_k=8: TPU tiles"):
    iha_attention(*args, implementation="pallas_tpu", block_sizes=BlockSizes(16, 8))
  # GPU tiles are powers of two of at least 16 rows (Triton's block shapes).
  with pytest.raises(ValueError, match="block_sizes.block_q=24: GPU tiles are powers of two"):
    iha_attention(*args, implementation="pallas_gpu", block_sizes=BlockSizes(24, 16))
  with pytest.raises(ValueError, match="block_sizes.block_q=8: GPU tiles are powers of two"):
    iha_attention(*args, implementation="pallas_gpu", block_sizes=BlockSizes(8, 16))


def test_auto_is_xla_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip(f"backend is {jax.default_backend()}, not cpu")
  assert registry.resolve("iha", "auto") == "xla"


# --- What the custom VJP saves. --------------------------------------------------------------
B, N, H, D, P = 1, 20, 2, 16, 2


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


@pytest.mark.parametrize("implementation", [GPU, TPU])
def test_kernels_save_only_the_pseudo_output(implementation, capsys):
  """Pseudo q/k/v are made by einsums (in the forward and again in the backward), never
  saved: of the residuals only the pseudo output o is P-sized."""
  shapes = _residual_shapes(implementation, capsys)
  virtual = _virtual_axis_shapes(shapes)
  assert len(virtual) == 1, shapes  # o [B, H, N * P (padded), d]
  assert np.prod(virtual[0]) <= B * H * 32 * P * D


def test_onchip_window_path_saves_only_the_calls_own_arrays(capsys):
  """The on-chip window path's backward recomputes every tile: its residuals are the
  call's inputs (source q, k, v, the mixing tensors, the token arrays), nothing P-sized
  and no padded or rotated copy of a source array."""
  shapes = _residual_shapes(WINDOW, capsys)
  assert not _virtual_axis_shapes(shapes), shapes
  inputs = {(B, N, H, D), (H, H, P)}
  assert set(shapes) <= inputs | {(B, N)}, shapes


def test_residual_check_flags_materialised_path(capsys):
  assert len(_virtual_axis_shapes(_residual_shapes("xla", capsys))) > 1


# --- shard_map over 8 fake CPU devices. ------------------------------------------------------
@pytest.mark.parametrize(
  "per_head, axis_type, causal, kv_heads",
  [pytest.param(False, "explicit", True, 2, marks=pytest.mark.full), (True, "auto", False, None)],
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
