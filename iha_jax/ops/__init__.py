"""Pure functions of Interleaved Head Attention (no Flax): IHA_SPEC sections 1 and 3."""
from iha_jax.ops.attention import BlockSizes, iha_attention, mha_attention, resolve_implementation
from iha_jax.ops.interleave import deinterleave, interleave, virtual_positions, virtual_segment_ids
from iha_jax.ops.masking import visible
from iha_jax.ops.mixing import collapse_heads, pseudo_mix
from iha_jax.ops.reference import attention_probs, dense_attention
from iha_jax.ops.rope import apply_rope, rope_frequencies
from iha_jax.ops.validation import IMPLEMENTATIONS
from iha_jax.ops.xla_attention import flash_attention

__all__ = [
    "BlockSizes", "IMPLEMENTATIONS", "apply_rope", "attention_probs", "collapse_heads", "deinterleave",
    "dense_attention", "flash_attention", "iha_attention", "interleave", "mha_attention",
    "pseudo_mix", "resolve_implementation", "rope_frequencies", "virtual_positions",
    "virtual_segment_ids", "visible",
]
