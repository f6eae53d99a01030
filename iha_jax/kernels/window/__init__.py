"""IHA's on-chip window paths: pseudo-heads made, attended and collapsed on chip
(`pallas_tpu_window`, `pallas_gpu_window`).

`common` holds what the twins share; per platform, bottom to top: the tiling
(`tpu_plan`, `gpu_plan`), the kernel bodies (`tpu_kernel`; `gpu_mixing`, `gpu_kernel`,
`gpu_backward_kernel`), and the entry with its operands, calls and custom VJP (`tpu`,
`gpu`: `window_iha`, `plan_for`, `unsupported`).
"""
