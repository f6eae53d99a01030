"""Pallas attention kernels (TPU: Mosaic, GPU: Triton), forward and backward.

`pallas_iha` / `pallas_mha` (`iha_jax.kernels.flash.attention`) take the source heads:
pseudo-heads mixed by einsums in HBM, flash attention over the virtual rows, the
collapse; `sharded_iha_attention` / `sharded_mha_attention` run them inside
`jax.shard_map` (`iha_jax.kernels.sharded`); `tpu_window.window_iha` is IHA's on-chip
window path. Most callers want `iha_jax.ops.iha_attention(...,
implementation="pallas_tpu")`, which checks its arguments and routes over the mesh.
"""

from iha_jax.kernels.flash.attention import iha as pallas_iha
from iha_jax.kernels.flash.attention import mha as pallas_mha
from iha_jax.kernels.sharded import sharded_iha_attention, sharded_mha_attention

__all__ = ["pallas_iha", "pallas_mha", "sharded_iha_attention", "sharded_mha_attention"]
