"""Initializers of the head-mixing parameters: defined in `iha_jax.kinds.initializers`
(below the layers, beside the kind records that use them), re-exported here."""

from iha_jax.kinds.initializers import (
  fold_fan_in,
  identity_collapse_init,
  identity_mixing_init,
  identity_talking_init,
)

__all__ = ["fold_fan_in", "identity_collapse_init", "identity_mixing_init", "identity_talking_init"]
