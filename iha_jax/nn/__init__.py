"""Flax layers of Interleaved Head Attention (IHA_SPEC section 3): NNX and Linen."""
from iha_jax.nn.attention import InterleavedHeadAttention, MultiHeadAttention
from iha_jax.nn.config import AttentionConfig, ParamSpec, param_specs
from iha_jax.nn.functional import attention_forward, project_qkv, to_compute_dtype
from iha_jax.nn.initializers import fold_fan_in, identity_collapse_init, identity_mixing_init
from iha_jax.nn.linen import InterleavedHeadAttentionLinen, MultiHeadAttentionLinen
from iha_jax.nn.partitioning import logical_param

__all__ = [
    "AttentionConfig", "InterleavedHeadAttention", "InterleavedHeadAttentionLinen",
    "MultiHeadAttention", "MultiHeadAttentionLinen", "ParamSpec", "attention_forward",
    "fold_fan_in", "identity_collapse_init", "identity_mixing_init", "logical_param",
    "param_specs", "project_qkv", "to_compute_dtype",
]
