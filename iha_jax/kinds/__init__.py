"""Attention kinds: one record per kind (`AttentionKind`), one file per kind.

A record holds a kind's schedule letters, parameter layout, layer core, implementations,
FLOP count and decoding support (`iha_jax.kinds.base`); the NNX and Linen layers,
`TransformerLM`, KV-cache decoding and the budgets read it. A new kind is a subclass of
`AttentionKind` in its own file plus `register(NewKind())` (below for the built-ins).

Layering: `iha_jax.ops` and `iha_jax.kernels` <- `iha_jax.kinds` <- `iha_jax.nn`.
"""

from iha_jax.kinds import registry
from iha_jax.kinds.base import (
  ATTENTION_OUT,
  KEY_PROJ,
  QUERY_PROJ,
  VALUE_PROJ,
  AttentionKind,
  Letter,
  ParamSpec,
  project,
  project_qkv,
)
from iha_jax.kinds.config import AttentionConfig
from iha_jax.kinds.differential import DIFFERENTIAL
from iha_jax.kinds.iha import IHA
from iha_jax.kinds.mha import MHA
from iha_jax.kinds.registry import (
  LETTER_DESCRIPTIONS,
  for_letter,
  get,
  mixing_params,
  names,
  register,
  unregister,
)
from iha_jax.kinds.simplicial import SIMPLICIAL
from iha_jax.kinds.talking_heads import TALKING_HEADS

for _record in (IHA, MHA, TALKING_HEADS, DIFFERENTIAL, SIMPLICIAL):
  register(_record)

__all__ = [
  "ATTENTION_OUT",
  "AttentionConfig",
  "AttentionKind",
  "KEY_PROJ",
  "LETTER_DESCRIPTIONS",
  "Letter",
  "ParamSpec",
  "QUERY_PROJ",
  "VALUE_PROJ",
  "for_letter",
  "get",
  "mixing_params",
  "names",
  "project",
  "project_qkv",
  "register",
  "registry",
  "unregister",
]
