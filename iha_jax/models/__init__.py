"""Models built from the `iha_jax.nn` layers (docs/design.md §3).

`TransformerLM` is the NNX module (import it into other models, decode with it);
`FunctionalTransformerLM` runs the same module as pure functions of a parameter dict, with
scan-over-layers and remat: the trainer, the evaluator and the exporters use it.
"""

from iha_jax.models.config import SCHEDULE_LETTERS, TransformerConfig, expand_schedule
from iha_jax.models.functional_lm import FunctionalTransformerLM, remat_policy
from iha_jax.models.layers import DecoderBlock, FeedForward, RMSNorm, make_attention
from iha_jax.models.transformer import TransformerLM, count_params

__all__ = [
  "DecoderBlock",
  "FeedForward",
  "FunctionalTransformerLM",
  "RMSNorm",
  "SCHEDULE_LETTERS",
  "TransformerConfig",
  "TransformerLM",
  "count_params",
  "expand_schedule",
  "make_attention",
  "remat_policy",
]
