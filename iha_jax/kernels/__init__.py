"""Pallas attention kernels (TPU: Mosaic, GPU: Triton), forward and backward.

`pallas_iha` / `pallas_mha` (`iha_jax.kernels.flash.attention`) take the source heads:
pseudo-heads mixed by einsums in HBM, flash attention over the virtual rows, the
collapse; `sharded_iha_attention` / `sharded_mha_attention` run them inside
`jax.shard_map` (`iha_jax.kernels.sharded`); `window.tpu.window_iha` and
`window.gpu.window_iha` are IHA's on-chip window paths. Most callers want
`iha_jax.ops.iha_attention(..., implementation="pallas_tpu")`, which checks its
arguments and routes over the mesh.

Layout: two families in folders, each bottom to top plan -> kernel bodies -> calls ->
entry: `flash/` (materialised pseudo q/k/v: "pallas_tpu", "pallas_gpu") and `window/`
(the on-chip window paths; `window/common.py` what the TPU and GPU twins share); what
each backend's kernels share in `tpu.py` (Mosaic) and `gpu.py` (Triton); `splash.py`
(jax's splash attention) and `sharded.py` (the kernels under a mesh) route calls.
"""

from iha_jax.kernels.flash.attention import iha as pallas_iha
from iha_jax.kernels.flash.attention import mha as pallas_mha
from iha_jax.kernels.sharded import sharded_iha_attention, sharded_mha_attention

__all__ = ["pallas_iha", "pallas_mha", "sharded_iha_attention", "sharded_mha_attention"]
