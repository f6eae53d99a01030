"""The functional API (no Flax): every attention kind's checked entry point, and the pure
functions a user calls beside them.

Entry points: `iha_attention`, `mha_attention`, `talking_heads_attention`,
`diff_attention`, `simplicial_attention`, `pha_attention`. Each takes its arrays, then one
`AttentionOptions` (window, causal, RoPE, segment ids, positions, tiles, implementation)
and/or the same options as keywords (typed: `OptionFields`), checks them and runs the
implementation its kind's record names (`iha_jax.kinds.registry.attend`; "auto" per
backend and call).

This package only gathers names (the entry points live with their kinds' records in
`iha_jax.kinds`, the math in `iha_jax.core`); nothing below the layers imports it.
"""

from iha_jax.core.differential import diff_lambda_init
from iha_jax.core.interleave import deinterleave, interleave, virtual_positions, virtual_segment_ids
from iha_jax.core.masking import Mask, visible
from iha_jax.core.mixing import collapse_heads, pseudo_mix
from iha_jax.core.norm import rms_norm
from iha_jax.core.options import AttentionOptions, BlockSizes, OptionFields
from iha_jax.core.reference import dense_attention, dense_attention_probabilities
from iha_jax.core.rope import apply_rope, rope_frequencies
from iha_jax.core.xla_attention import attention_probabilities, flash_attention_heads_major
from iha_jax.kinds import (
  diff_attention,
  iha_attention,
  mha_attention,
  pha_attention,
  simplicial_attention,
  talking_heads_attention,
)

__all__ = [
  "AttentionOptions",
  "BlockSizes",
  "Mask",
  "OptionFields",
  "apply_rope",
  "attention_probabilities",
  "collapse_heads",
  "deinterleave",
  "dense_attention",
  "dense_attention_probabilities",
  "diff_attention",
  "diff_lambda_init",
  "flash_attention_heads_major",
  "iha_attention",
  "interleave",
  "mha_attention",
  "pha_attention",
  "pseudo_mix",
  "rms_norm",
  "rope_frequencies",
  "simplicial_attention",
  "talking_heads_attention",
  "virtual_positions",
  "virtual_segment_ids",
  "visible",
]
