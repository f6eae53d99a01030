"""Flash attention over materialised pseudo q/k/v: the `pallas_tpu` and `pallas_gpu` paths.

Bottom to top: `plan` (which tile pairs a grid step attends), the kernel bodies
(`tpu_kernel`: Mosaic, `gpu_kernel`: Triton), their calls (`tpu`, `gpu`), the pseudo
rows made in HBM (`mixing`), and the entry with its custom VJP (`attention`: `iha`, `mha`).
"""
