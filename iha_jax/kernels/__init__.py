"""Pallas fused IHA attention kernels (TPU: Mosaic, GPU: Triton), forward and backward.

`iha_attention` / `mha_attention` take the source heads and build pseudo-heads on
chip; see `iha_jax.kernels.fused` for layouts, residuals and platform dispatch.
"""

from iha_jax.kernels.fused import iha_attention, mha_attention

__all__ = ["iha_attention", "mha_attention"]
