"""Models built from the `iha_jax.nn` layers (docs/design.md §3).

`TransformerLM` is the NNX module (import it into other models, decode with it);
`FunctionalTransformerLM` runs the same module as pure functions of a parameter dict, with
scan-over-layers and remat: the trainer, the evaluator and the exporters use it.
"""

import warnings as _warnings

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


_DEPRECATED = {"LanguageModel": "FunctionalTransformerLM"}


def __getattr__(name: str):
  if name in _DEPRECATED:
    new = _DEPRECATED[name]
    _warnings.warn(
      f"iha_jax.models.{name} is deprecated; use iha_jax.models.{new}",
      DeprecationWarning,
      stacklevel=2,
    )
    return globals()[new]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
