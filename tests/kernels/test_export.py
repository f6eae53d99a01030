"""The Pallas kernels lower for real TPUs and NVIDIA GPUs from this CPU-only host.

`jax.export` with `platforms=["tpu"]` emits Mosaic (`tpu_custom_call`) and with
`platforms=["cuda"]` emits Triton (`__gpu$xla.gpu.triton`): `lax.platform_dependent`
in `iha_jax.kernels.flash.attention` picks the compiled kernels for those platforms. The
Triton custom call embeds Triton IR with no serialization-compatibility
guarantee, so exporting it needs `DisabledSafetyCheck.custom_call` (checked below);
the lowering itself is complete. Mosaic's final compile (layouts, VMEM limits)
happens in the TPU compiler and Triton's PTX generation in XLA:GPU, neither of
which runs here. Triton lowers for the H100 named by `targets.lowering_for` (jax 0.11+
needs a GPU named when none is present).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from iha_jax.ops import iha_attention, mha_attention
from iha_jax.parallel import targets

TARGETS = {"tpu": ("pallas_tpu", "tpu_custom_call"), "cuda": ("pallas_gpu", "__gpu$xla.gpu.triton")}
# (B, N, H, d, P, window, causal): the paper's shape (docs/design.md §4: N = 8192, H = 20,
# d = 128, P = 4, window N/(2P) = 1024 virtual tokens), and a small bidirectional one.
SHAPES = {"paper": (1, 8192, 20, 128, 4, 1024, True), "small": (2, 200, 4, 64, 2, 96, False)}


def _export(fn, platform, *args):
  checks = [jax.export.DisabledSafetyCheck.custom_call(TARGETS["cuda"][1])]
  with targets.lowering_for(platform):
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


def _custom_calls(exported) -> set[str]:
  return set(re.findall(r"custom_call @([\w$.]+)", exported.mlir_module()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_iha_exports(shape, platform, grad):
  b, n, h, d, p, window, causal = SHAPES[shape]
  implementation, target = TARGETS[platform]
  x = jax.ShapeDtypeStruct((b, n, h, d), jnp.bfloat16)
  a = jax.ShapeDtypeStruct((h, h, p), jnp.bfloat16)
  attend = lambda *args: iha_attention(
    *args, window=window, causal=causal, implementation=implementation
  )
  f = attend
  if grad:
    f = jax.grad(
      lambda *args: jnp.sum(attend(*args).astype(jnp.float32) ** 2), argnums=tuple(range(7))
    )
  exported = _export(f, platform, x, x, x, a, a, a, a)
  assert target in _custom_calls(exported)
  # Both platforms mix pseudo q/k/v in HBM by design (iha_jax.kernels.flash.attention;
  # tests/kernels/test_kernels.py checks the backward saves none of them).


@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_mha_gradient_exports(platform):
  # v twice as wide as q/k, as differential attention calls it.
  implementation, target = TARGETS[platform]
  x = jax.ShapeDtypeStruct((1, 8192, 20, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 8192, 20, 256), jnp.bfloat16)
  f = jax.grad(
    lambda *args: jnp.sum(
      mha_attention(*args, implementation=implementation).astype(jnp.float32) ** 2
    ),
    argnums=(0, 1, 2),
  )
  assert target in _custom_calls(_export(f, platform, x, x, v))


def test_triton_export_needs_the_custom_call_check_disabled():
  x = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.bfloat16)
  f = lambda *args: mha_attention(*args, implementation="pallas_gpu")
  with targets.lowering_for("cuda"), pytest.raises(ValueError, match="no compatibility guarantees"):
    jax.export.export(jax.jit(f), platforms=["cuda"])(x, x, x)
