"""Fused Pallas kernels against the dense reference, in interpret mode on CPU.

GPU (Triton) kernels run through the public dispatcher: off-GPU they lower to
Pallas' interpreter automatically. TPU (Mosaic) kernels additionally run under
`pltpu.force_tpu_interpret_mode()`, which models Mosaic semantics (SMEM, VMEM
scratch, grid order). Every case checks the forward and every gradient (q, k, v,
alpha_*, collapse) with a random cotangent, with packed segments, padding
tokens and a sequence that does not divide the tiles; causal and bidirectional
(`causal=False`) cases, and MHA with a value wider than q/k.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from iha_jax.kernels import fused
from iha_jax.kernels.sharded import sharded_iha_attention
from iha_jax.ops import BlockSizes, iha_attention, mha_attention, resolve_implementation
from tests.utils import assert_close, packed_positions, packed_segments, random_iha_inputs


def _mode(platform: str):
  return pltpu.force_tpu_interpret_mode() if platform == "tpu" else contextlib.nullcontext()


def _check_iha(
  platform,
  *,
  b,
  n,
  h,
  d,
  p,
  window,
  dtype=jnp.float32,
  blocks=None,
  per_head=False,
  rope_theta=10000.0,
  causal=True,
  seed=0,
):
  args = random_iha_inputs(jax.random.key(seed), b, n, h, d, p, per_head=per_head, dtype=dtype)
  seg = packed_segments(b, n)
  pos = packed_positions(seg)
  cotangent = jax.random.normal(jax.random.key(seed + 1), (b, n, h, d), dtype)

  def run(implementation, block_sizes=None):
    f = lambda *a: iha_attention(
      *a,
      window=window,
      segment_ids=seg,
      positions=pos,
      rope_theta=rope_theta,
      causal=causal,
      implementation=implementation,
      block_sizes=block_sizes,
    )
    out, vjp = jax.vjp(f, *args)
    return out, vjp(cotangent)

  with _mode(platform):
    got = run(f"pallas_{platform}", blocks)
  want = run("reference")
  assert_close(got[0], want[0], dtype, "out")
  assert_close(got[1], want[1], dtype, "grads")


# Triton interpret: 8-token tiles over N = 20 (padded to 24: three tiles each way).
# P in {1, 2, 4} with global and window layers, spread over these and the bidirectional
# and bfloat16 cases below (P = 2 and 4 each run global and windowed).
@pytest.mark.parametrize("p, window", [(1, 13), (2, None), (4, 13)])
def test_gpu_iha_float32(p, window):
  _check_iha("gpu", b=2, n=20, h=2, d=16, p=p, window=window, blocks=BlockSizes(8 * p, 8 * p))


# Bidirectional: with a 5-row window on 16-row virtual tiles, a tile sees its neighbours on
# both sides only (the symmetric band); globally every tile sees every tile.
@pytest.mark.parametrize("window", [None, 5])
def test_gpu_iha_bidirectional(window):
  _check_iha(
    "gpu", b=2, n=20, h=2, d=16, p=2, window=window, causal=False, blocks=BlockSizes(16, 16)
  )


@pytest.mark.parametrize("p, window", [(2, 13), (4, None)])
def test_gpu_iha_bfloat16(p, window):
  _check_iha(
    "gpu",
    b=2,
    n=20,
    h=2,
    d=16,
    p=p,
    window=window,
    dtype=jnp.bfloat16,
    blocks=BlockSizes(8 * p, 8 * p),
  )


def test_gpu_iha_per_head_no_rope_odd_dim_default_blocks():
  # d = 15 is padded per lane half to the kernels' power-of-two width.
  _check_iha("gpu", b=1, n=24, h=3, d=15, p=3, window=None, per_head=True, rope_theta=None)


def test_gpu_iha_paper_default_p_equals_h_20():
  # P = H = 20 (the paper's default): 400 piece pairs per tile, unrolled in the kernels.
  # Two 16-token tiles of 320 virtual rows, with padding, segments and a window.
  _check_iha("gpu", b=1, n=20, h=20, d=16, p=20, window=150, blocks=BlockSizes(16 * 20, 16 * 20))


# Mosaic interpret: key tiles are multiples of 128 tokens, so N = 136 gives two key
# tiles and eight query tiles (padded to 256; five hold tokens). Bidirectional window
# 100 at P = 2: query tiles 0-1 see key tile 0 only, 2-5 both, and key tile 0 is seen
# by query tiles 0-5 only; batch row 1 is one document across both key tiles (row 0's
# second key tile is padding). P = 1 runs through the TPU kernels in the MHA test.
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_tpu_iha_multi_tile_float32(causal):
  _check_iha(
    "tpu", b=2, n=136, h=2, d=16, p=2, window=100, causal=causal, blocks=BlockSizes(64, 256)
  )


@pytest.mark.parametrize("p, window, dtype", [(4, 9, jnp.float32), (2, None, jnp.bfloat16)])
def test_tpu_iha_single_tile(p, window, dtype):
  _check_iha("tpu", b=2, n=20, h=2, d=16, p=p, window=window, dtype=dtype)


# v twice as wide as q/k (differential attention's MHA call): dq, dk `[.., d]`, dv `[.., 2d]`.
@pytest.mark.parametrize("platform, causal", [("gpu", True), ("tpu", False)])
def test_mha_through_kernels(platform, causal):
  b, n, h, d = 2, 20, 3, 16
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q, k = (jax.random.normal(key, (b, n, h, d)) for key in (kq, kk))
  v = jax.random.normal(kv, (b, n, h, 2 * d))
  seg = packed_segments(b, n)
  cotangent = jax.random.normal(jax.random.key(4), (b, n, h, 2 * d))
  blocks = BlockSizes(8, 8) if platform == "gpu" else None

  def run(implementation):
    f = lambda *a: mha_attention(
      *a,
      window=5,
      segment_ids=seg,
      causal=causal,
      implementation=implementation,
      block_sizes=blocks,
    )
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cotangent)

  with _mode(platform):
    got = run(f"pallas_{platform}")
  assert_close(got, run("reference"), jnp.float32)


def test_blocks_must_hold_whole_tokens():
  args = random_iha_inputs(jax.random.key(0), 1, 16, 2, 16, 2)
  with pytest.raises(ValueError, match="multiple of P"):
    iha_attention(*args, implementation="pallas_gpu", block_sizes=BlockSizes(15, 16))
  with pytest.raises(ValueError, match="power-of-two"):
    iha_attention(*args, implementation="pallas_gpu", block_sizes=BlockSizes(24, 16))


def test_auto_is_xla_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip(f"backend is {jax.default_backend()}, not cpu")
  assert resolve_implementation("auto") == "xla"


# --- No P-sized pseudo q/k/v anywhere. ------------------------------------------------------
B, N, H, D, P = 1, 20, 2, 16, 2


def _grad_fn(implementation):
  def loss(*args):
    out = iha_attention(*args, window=13, implementation=implementation)
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
  args = random_iha_inputs(jax.random.key(0), B, N, H, D, P)
  text = (
    jax.jit(_grad_fn(implementation)).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  )
  return [
    tuple(int(x) for x in dims.split("x")[:-1])
    for dims in re.findall(r"tensor<([\dx]+x(?:f32|bf16|i32))>", text)
  ]


@pytest.mark.parametrize(
  "implementation, platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu"), ("pallas_gpu", "cpu")]
)
def test_lowered_gradient_program_has_no_pseudo_qkv(implementation, platform):
  assert not _virtual_axis_shapes(_lowered_shapes(implementation, platform))


def test_lowered_scan_flags_materialised_path():
  assert _virtual_axis_shapes(_lowered_shapes("xla", "cpu"))


# --- shard_map over 8 fake CPU devices. ------------------------------------------------------
@pytest.mark.parametrize(
  "per_head, axis_type, causal", [(False, "explicit", True), (True, "auto", False)]
)
def test_sharded_kernels_match_reference(per_head, axis_type, causal):
  axis_types = (
    jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto,
  ) * 2
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=axis_types)
  b, n, h, d, p = 4, 16, 4, 16, 2
  args = random_iha_inputs(jax.random.key(5), b, n, h, d, p, per_head=per_head)
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
  o, restore = fused.pseudo_outputs(
    *args[:3],
    args[3:6],
    window=None,
    segment_ids=seg,
    positions=pos,
    rope_theta=10000.0,
    platform="gpu",
    block_sizes=None,
  )
  assert o.shape == (1, 2, 2, 32, 32)  # [B, H, P, Np, W]
  assert restore(jnp.zeros((1, 32, 5, 32))).shape == (1, 20, 5, 16)
