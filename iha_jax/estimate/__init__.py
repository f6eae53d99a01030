"""Estimated TPU time of a jitted program from libtpu's final schedule, on a CPU host.

A tool beside the stack, not part of it: nothing here imports the layers, kernels or
models. `tpu` is the entry (`tpu.prepare()` before libtpu loads, then
`tpu.estimate(jax.jit(f), *args)`); `llo` parses libtpu's schedule dump, `kernel_grid`
counts a Pallas kernel's grid steps, `pl.when` bodies, block copies and MXU work from its
jaxpr, `kernel_cost` turns both into a kernel's cycles, `chips` holds the chips' figures. Every
figure it gives is an estimate, never a measurement (docs/performance.md).
"""
