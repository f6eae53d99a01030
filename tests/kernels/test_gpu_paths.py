"""IHA's materialised GPU paths against the dense reference, and when "auto" picks them.

"cudnn" (`iha_jax.core.cudnn_attention`): on a GPU the conformance cases run cuDNN itself;
elsewhere they run the same pipeline (mixing, interleave, RoPE at virtual positions, the
window's mapping onto jax's `local_window_size`, collapse) with jax's XLA attention behind
it, so CI checks everything but the cuDNN call. "pallas_gpu_mha" (pseudo q/k/v + the Pallas
MHA kernel over the virtual sequence) runs the kernel compiled on a GPU, interpreted
elsewhere, with packed segments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from iha_jax import ops
from iha_jax.core import cudnn_attention
from iha_jax.kinds import registry
from tests import conformance as cf

B, N, H, D = 2, 12, 2, 8

KINDS = {
  "iha": cf.iha(H, D, 2),
  "iha_p3_h4_per_head": cf.iha(4, D, 3, per_head=True),
  "mha": cf.mha(H, D, D),
}
# What cuDNN covers: causal (global or window) and global bidirectional, unpacked.
MASKS = {
  "causal": dict(causal=True, window=None),
  "causal_window": dict(causal=True, window=5),
  "bidirectional": dict(causal=False, window=None),
}
# `make test`: each kind once, each mask class once; every pair in test-all.
CORE = {("iha", "causal_window"), ("mha", "causal"), ("iha_p3_h4_per_head", "bidirectional")}
CASES = [
  pytest.param(k, m, id=f"{k}-{m}", marks=() if (k, m) in CORE else pytest.mark.full)
  for k in KINDS
  for m in MASKS
]


@pytest.fixture
def cudnn_or_xla(monkeypatch):
  if jax.default_backend() != "gpu":
    monkeypatch.setattr(cudnn_attention, "BACKEND", "xla")


@pytest.mark.parametrize("name, mask", CASES)
def test_cudnn_matches_reference(cudnn_or_xla, name, mask):
  seed = list(KINDS).index(name) * 10 + list(MASKS).index(mask)
  cf.check(KINDS[name], "cudnn", b=B, n=N, mask=MASKS[mask], dtype=jnp.bfloat16, seed=seed)


@pytest.mark.parametrize(
  "mask",
  [dict(causal=True, window=5, packed=True), dict(causal=False, window=3, packed=True)],
  ids=["causal-window-packed", "bidirectional-window-packed"],
)
def test_pallas_gpu_mha_matches_reference(mask):
  """Virtual segment ids, positions and the window (virtual tokens) reach the MHA kernel;
  16-row tiles over 24 virtual tokens: several tiles, one partial."""
  cf.check(cf.iha(H, 16, 2), "pallas_gpu_mha", b=B, n=N, mask=mask, blocks=ops.BlockSizes(16, 16))


def _call(dtype=jnp.bfloat16, dv=D, **options):
  q = jnp.ones((B, N, H, D), dtype)
  v = jnp.ones((B, N, H, dv), dtype)
  return q, v, ops.AttentionOptions(**options)


@pytest.mark.parametrize(
  "dtype, dv, options, mha, iha",
  [
    (jnp.bfloat16, D, {}, "cudnn", "cudnn"),
    (jnp.bfloat16, D, {"window": 4}, "cudnn", "cudnn"),
    (jnp.bfloat16, D, {"segment_ids": jnp.ones((B, N), jnp.int32)}, "pallas_gpu", "pallas_gpu_mha"),
    (jnp.bfloat16, D, {"window": 4, "causal": False}, "pallas_gpu", "pallas_gpu_mha"),
    (jnp.bfloat16, 2 * D, {}, "pallas_gpu", None),
    (jnp.float32, D, {}, "pallas_gpu", "pallas_gpu_mha"),
  ],
  ids=["bf16", "window", "segments", "bidirectional-window", "wide-value", "float32"],
)
def test_auto_on_gpu_picks_the_fastest_path_the_call_allows(dtype, dv, options, mha, iha):
  q, v, opts = _call(dtype, dv, **options)
  with registry.auto_backend("gpu"):
    assert registry.resolve("mha", "auto", q, v, opts) == mha
    if iha:
      assert registry.resolve("iha", "auto", q, v, opts, num_pseudo=4) == iha
    # Without the call's arrays (e.g. a config check) "auto" names the fused kernels.
    assert registry.resolve("iha", "auto") == "pallas_gpu"
  with registry.auto_backend("tpu"):
    assert registry.resolve("iha", "auto", q, v, opts, num_pseudo=4) == "pallas_tpu"


def test_auto_keeps_large_iha_calls_on_the_fused_kernels(monkeypatch):
  """Materialising P copies of q/k/v past the per-device limit (the paper's P = 20 step
  would need 508 GiB per H100) leaves IHA on the memory-lean fused kernels."""
  q, v, opts = _call()
  size = registry.materialised_bytes(q, v, 4)
  assert size == 4 * 3 * q.size * 2
  with registry.auto_backend("gpu"):
    monkeypatch.setattr(registry, "MATERIALISE_LIMIT_BYTES", size)
    assert registry.resolve("iha", "auto", q, v, opts, num_pseudo=4) == "cudnn"
    monkeypatch.setattr(registry, "MATERIALISE_LIMIT_BYTES", size - 1)
    assert registry.resolve("iha", "auto", q, v, opts, num_pseudo=4) == "pallas_gpu"
    assert registry.resolve("mha", "auto", q, v, opts) == "cudnn"  # MHA copies nothing
    # Over a mesh the arrays are split: the bytes per device shrink with its size.
    mesh = jax.sharding.AbstractMesh((4,), ("data",))
    with jax.sharding.use_abstract_mesh(mesh):
      assert registry.materialised_bytes(q, v, 4) == size // 4
      assert registry.resolve("iha", "auto", q, v, opts, num_pseudo=4) == "cudnn"


def test_explicit_cudnn_names_what_it_lacks():
  q = jnp.ones((B, N, H, D), jnp.float32)
  with pytest.raises(ValueError, match="implementation='cudnn': .*bfloat16 or float16"):
    ops.mha_attention(q, q, q, implementation="cudnn")
  q = q.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="packed-segment"):
    ops.mha_attention(q, q, q, implementation="cudnn", segment_ids=jnp.ones((B, N), jnp.int32))


def test_model_wide_pallas_gpu_mha_serves_every_kernel_kind():
  """`model.implementation="pallas_gpu_mha"` must build an LLLLM (IHA + MHA layers) and a
  differential layer: for MHA it names the MHA kernel itself."""
  for kind in ("iha", "mha", "diff"):
    assert registry.resolve(kind, "pallas_gpu_mha") == "pallas_gpu_mha"
  same, kernel = (registry.lookup("mha", name) for name in ("pallas_gpu_mha", "pallas_gpu"))
  assert (same.func, same.keywords) == (kernel.func, kernel.keywords)
  with pytest.raises(ValueError, match="talking_heads attention has no 'pallas_gpu_mha'"):
    registry.resolve("talking_heads", "pallas_gpu_mha")
