"""Flax layers of every attention kind (IHA, MHA and the paper's baselines): NNX and Linen.

NNX: `Attention` (any kind, from its fields or `config=AttentionConfig(...)`) and its
named classes (`InterleavedHeadAttention`, ...); Linen: `AttentionLinen(config)` (the
per-kind Linen names still build it, deprecated). One call per layer serves training,
prefill and decoding with a KV cache (`cache=`, `iha_jax.nn.cache`), cross-attention
(`context=`) and attention probabilities (`return_probabilities=True`);
docs/your_model.md puts them in a model of your own and lists this public API. The
functions behind the layers (`iha_jax.nn.call`, `.functional`, `.cache`, `.cross`) are
internal.
"""

from iha_jax.nn.attention import (
  Attention,
  DifferentialAttention,
  InterleavedHeadAttention,
  MultiHeadAttention,
  PairedHeadAttention,
  SimplicialAttention,
  TalkingHeadsAttention,
)
from iha_jax.nn.cache import CACHE_MODES, LayerCache
from iha_jax.nn.config import MIXING_PARAMS, AttentionConfig
from iha_jax.nn.initializers import (
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
from iha_jax.nn.partitioning import logical_specs, param_shardings, unbox

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
  "PairedHeadAttention",
  "SimplicialAttention",
  "SimplicialAttentionLinen",
  "TalkingHeadsAttention",
  "TalkingHeadsAttentionLinen",
  "identity_collapse_init",
  "identity_mixing_init",
  "identity_talking_init",
  "logical_specs",
  "param_shardings",
  "unbox",
]
