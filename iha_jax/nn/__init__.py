"""Flax layers of every attention kind (IHA, MHA and the paper's baselines): NNX and Linen.

One call per layer serves training, prefill and decoding with a KV cache (`cache=`,
`iha_jax.nn.cache`) and attention probabilities (`return_probabilities=True`);
docs/your_model.md puts them in a model of your own.
"""

from iha_jax.nn.attention import (
  Attention,
  DifferentialAttention,
  InterleavedHeadAttention,
  MultiHeadAttention,
  SimplicialAttention,
  TalkingHeadsAttention,
)
from iha_jax.nn.cache import CACHE_MODES, LayerCache, cached_attention, init_layer_cache
from iha_jax.nn.call import apply_layer
from iha_jax.nn.config import MIXING_PARAMS, AttentionConfig, ParamSpec, layer_config, param_specs
from iha_jax.nn.functional import (
  attention_forward,
  layer_attention_probabilities,
  mask_segments,
  project_qkv,
  pseudo_heads,
  rotated_pseudo_heads,
  to_compute_dtype,
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
from iha_jax.nn.partitioning import logical_param, logical_specs, param_shardings, unbox

__all__ = [
  "CACHE_MODES",
  "MIXING_PARAMS",
  "Attention",
  "AttentionConfig",
  "AttentionLinen",
  "DifferentialAttention",
  "DifferentialAttentionLinen",
  "InterleavedHeadAttention",
  "InterleavedHeadAttentionLinen",
  "LayerCache",
  "MultiHeadAttention",
  "MultiHeadAttentionLinen",
  "ParamSpec",
  "SimplicialAttention",
  "SimplicialAttentionLinen",
  "TalkingHeadsAttention",
  "TalkingHeadsAttentionLinen",
  "apply_layer",
  "attention_forward",
  "cached_attention",
  "fold_fan_in",
  "identity_collapse_init",
  "identity_mixing_init",
  "identity_talking_init",
  "init_layer_cache",
  "layer_attention_probabilities",
  "layer_config",
  "logical_param",
  "logical_specs",
  "param_shardings",
  "mask_segments",
  "param_specs",
  "project_qkv",
  "pseudo_heads",
  "rotated_pseudo_heads",
  "to_compute_dtype",
  "unbox",
]
