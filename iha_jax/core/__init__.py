"""The bottom of the attention stack: pure JAX functions that import nothing above them.

Options (`options.AttentionOptions`), argument checks (`validation`), the mask predicate
(`masking`), RoPE, head mixing and interleaving, the dense test oracle (`reference`), the
memory-efficient XLA core (`xla_attention`, `grouped`, `query_blocks`), cuDNN's call, and
the unchecked reference / XLA implementations of every built-in kind (`attention`,
`talking_heads`, `differential`, `simplicial`). Nothing here chooses an implementation:
the kinds' records (`iha_jax.kinds`) name these functions and the Pallas kernels as
their implementations, and their entry points (re-exported by `iha_jax.ops`, the
functional API) check a call and dispatch it. Layering: docs/design.md §8.
"""
