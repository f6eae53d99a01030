"""Pallas attention kernels (TPU: Mosaic, GPU: Triton), forward and backward.

`pallas_iha` / `pallas_mha` (`flash.attention`) take the source heads and run the
materialised pipeline (pseudo q/k/v mixed in HBM, flash attention, the collapse);
`sharded_iha_attention` / `sharded_mha_attention` (`sharded`) run them inside
`jax.shard_map`; `window.tpu` / `window.gpu` are IHA's on-chip window paths; `splash`
runs jax's splash attention. Most callers want `iha_jax.ops.iha_attention(...,
implementation="pallas_tpu")`, which checks its arguments and routes over the mesh.
Each family (`flash/`, `window/`) reads bottom to top: plan, kernel bodies, calls, entry;
what each backend's kernels share is `tpu.py` (Mosaic) and `gpu.py` (Triton).
"""

from iha_jax.kernels.flash.attention import iha as pallas_iha
from iha_jax.kernels.flash.attention import mha as pallas_mha
from iha_jax.kernels.sharded import sharded_iha_attention, sharded_mha_attention

__all__ = ["pallas_iha", "pallas_mha", "sharded_iha_attention", "sharded_mha_attention"]
