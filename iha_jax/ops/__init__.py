"""Pure functions of the attention kinds (no Flax): IHA, MHA and the paper's baselines.

Entry points: `iha_attention`, `mha_attention`, `talking_heads_attention`,
`diff_attention`, `simplicial_attention`. Each takes its arrays, then one
`AttentionOptions` (window, causal, RoPE, segment ids, positions, tiles, implementation)
and/or the same options as keywords; `iha_jax.ops.registry` picks the implementation.
"""

from iha_jax.ops.attention import iha_attention, mha_attention, resolve_implementation
from iha_jax.ops.differential import diff_attention, diff_lambda_init
from iha_jax.ops.interleave import deinterleave, interleave, virtual_positions, virtual_segment_ids
from iha_jax.ops.masking import visible
from iha_jax.ops.mixing import collapse_heads, pseudo_mix
from iha_jax.ops.options import IMPLEMENTATIONS, AttentionOptions, BlockSizes
from iha_jax.ops.reference import attention_probs, dense_attention
from iha_jax.ops.registry import KINDS
from iha_jax.ops.rope import apply_rope, rope_frequencies
from iha_jax.ops.simplicial import simplicial_attention
from iha_jax.ops.talking_heads import talking_heads_attention
from iha_jax.ops.xla_attention import attention_probabilities, flash_attention_heads_major

__all__ = [
  "AttentionOptions",
  "BlockSizes",
  "IMPLEMENTATIONS",
  "KINDS",
  "apply_rope",
  "attention_probabilities",
  "attention_probs",
  "collapse_heads",
  "deinterleave",
  "dense_attention",
  "diff_attention",
  "diff_lambda_init",
  "flash_attention_heads_major",
  "iha_attention",
  "interleave",
  "mha_attention",
  "pseudo_mix",
  "resolve_implementation",
  "rope_frequencies",
  "simplicial_attention",
  "talking_heads_attention",
  "virtual_positions",
  "virtual_segment_ids",
  "visible",
]
