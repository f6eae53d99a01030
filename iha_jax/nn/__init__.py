"""Flax layers of every attention kind (IHA, MHA and the paper's baselines): NNX and Linen."""

from iha_jax.nn.attention import (
  Attention,
  DifferentialAttention,
  InterleavedHeadAttention,
  MultiHeadAttention,
  SimplicialAttention,
  TalkingHeadsAttention,
)
from iha_jax.nn.config import MIXING_PARAMS, AttentionConfig, ParamSpec, param_specs
from iha_jax.nn.functional import (
  attention_forward,
  project_qkv,
  pseudo_heads,
  rotated_pseudo_heads,
  to_compute_dtype,
  virtual_per_token,
)
from iha_jax.nn.initializers import (
  fold_fan_in,
  identity_collapse_init,
  identity_mixing_init,
  identity_talking_init,
)
from iha_jax.nn.linen import (
  AttentionLinen,
  DifferentialAttentionLinen,
  InterleavedHeadAttentionLinen,
  MultiHeadAttentionLinen,
  SimplicialAttentionLinen,
  TalkingHeadsAttentionLinen,
)
from iha_jax.nn.partitioning import logical_param

__all__ = [
  "Attention",
  "AttentionConfig",
  "AttentionLinen",
  "DifferentialAttention",
  "DifferentialAttentionLinen",
  "InterleavedHeadAttention",
  "InterleavedHeadAttentionLinen",
  "MIXING_PARAMS",
  "MultiHeadAttention",
  "MultiHeadAttentionLinen",
  "ParamSpec",
  "SimplicialAttention",
  "SimplicialAttentionLinen",
  "TalkingHeadsAttention",
  "TalkingHeadsAttentionLinen",
  "attention_forward",
  "fold_fan_in",
  "identity_collapse_init",
  "identity_mixing_init",
  "identity_talking_init",
  "logical_param",
  "param_specs",
  "project_qkv",
  "pseudo_heads",
  "rotated_pseudo_heads",
  "to_compute_dtype",
  "virtual_per_token",
]
