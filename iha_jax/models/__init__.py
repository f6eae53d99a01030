"""Models built from the `iha_jax.nn` layers (docs/design.md §3)."""

from iha_jax.models.config import SCHEDULE_LETTERS, TransformerConfig, expand_schedule
from iha_jax.models.language_model import LanguageModel, remat_policy
from iha_jax.models.layers import DecoderBlock, FeedForward, RMSNorm, make_attention
from iha_jax.models.transformer import TransformerLM, count_params

__all__ = [
  "DecoderBlock",
  "FeedForward",
  "LanguageModel",
  "RMSNorm",
  "SCHEDULE_LETTERS",
  "TransformerConfig",
  "TransformerLM",
  "count_params",
  "expand_schedule",
  "make_attention",
  "remat_policy",
]
