"""The bottom of the attention stack: pure JAX functions that import nothing above them.

Options (`options.AttentionOptions`), argument checks (`validation`), the mask predicate
(`masking`), RoPE, head mixing and interleaving, the dense test oracle (`reference`), the
memory-efficient XLA core (`xla_attention`, `grouped`, `query_blocks`), cuDNN's call, and
the unchecked reference / XLA implementations of every built-in kind (`attention`,
`talking_heads`, `differential`, `simplicial`). Nothing here chooses an implementation:
the kinds' records (`iha_jax.kinds`) do. Layering: docs/design.md §8.
"""
