"""Pallas IHA attention kernels (TPU: Mosaic, GPU: Triton), forward and backward.

`fused_iha_attention` / `fused_mha_attention` take the source heads (pseudo-heads mixed
by einsums in HBM, then flash attention over the virtual rows:
`iha_jax.kernels.virtual_attention`);
`sharded_iha_attention` / `sharded_mha_attention` run them inside `jax.shard_map`
(`iha_jax.kernels.sharded`). Most callers want `iha_jax.ops.iha_attention(...,
implementation="pallas_tpu")`, which checks its arguments and picks between the two.
"""

import functools
import warnings

from iha_jax.core.options import AttentionOptions
from iha_jax.kernels import fused
from iha_jax.kernels.fused import fused_iha_attention, fused_mha_attention
from iha_jax.kernels.sharded import sharded_iha_attention, sharded_mha_attention

__all__ = [
  "fused_iha_attention",
  "fused_mha_attention",
  "sharded_iha_attention",
  "sharded_mha_attention",
]


def _keyword_kernel(name: str, *arrays, platform: str, **options):
  return getattr(fused, f"fused_{name}")(*arrays, AttentionOptions(**options), platform=platform)


def __getattr__(name: str):
  # Deprecated: `iha_jax.kernels.iha_attention` / `mha_attention` shared the names of the
  # checked `iha_jax.ops` entry points with another contract (keyword options).
  if name in ("iha_attention", "mha_attention"):
    warnings.warn(
      f"iha_jax.kernels.{name} is deprecated: use iha_jax.ops.{name}(..., "
      f'implementation="pallas_tpu" or "pallas_gpu"), or iha_jax.kernels.fused_{name} '
      "(options as one AttentionOptions)",
      DeprecationWarning,
      stacklevel=2,
    )
    return functools.partial(_keyword_kernel, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
