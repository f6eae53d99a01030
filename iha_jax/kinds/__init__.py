"""Attention kinds: one record per kind (`AttentionKind`) in its own file with its checked
entry point (`iha_attention`, ..., re-exported by `iha_jax.ops`), and the registry that
checks, resolves and runs their calls.

A record holds a kind's schedule letters, parameter layout, layer core, implementations
(callables), entry-point checks, FLOP count and decoding support; the layers, the models,
decoding and the budgets read it. A new kind is a subclass of `AttentionKind` plus
`register(NewKind())` (below for the built-ins). Layering (docs/design.md §8):
`iha_jax.core` <- `iha_jax.kernels` <- `iha_jax.kinds` <- `iha_jax.ops` and `iha_jax.nn`.
"""

from iha_jax.kinds import registry
from iha_jax.kinds.base import (
  ATTENTION_OUT,
  BIAS_PARAMS,
  KEY_PROJ,
  QUERY_PROJ,
  VALUE_PROJ,
  AttentionKind,
  Letter,
  ParamSpec,
  project,
  project_out,
  project_qkv,
)
from iha_jax.kinds.config import AttentionConfig, effective_num_pseudo
from iha_jax.kinds.differential import DIFFERENTIAL, diff_attention
from iha_jax.kinds.iha import IHA, iha_attention
from iha_jax.kinds.mha import MHA, mha_attention
from iha_jax.kinds.pha import PHA, pha_attention
from iha_jax.kinds.registry import (
  LETTER_DESCRIPTIONS,
  attend,
  auto_backend,
  for_letter,
  get,
  implementation_names,
  implementations,
  lookup,
  mixing_params,
  names,
  register,
  resolve,
  unregister,
)
from iha_jax.kinds.simplicial import SIMPLICIAL, simplicial_attention
from iha_jax.kinds.talking_heads import TALKING_HEADS, talking_heads_attention

for _record in (IHA, MHA, TALKING_HEADS, DIFFERENTIAL, SIMPLICIAL, PHA):
  register(_record)

__all__ = [
  "ATTENTION_OUT",
  "BIAS_PARAMS",
  "AttentionConfig",
  "AttentionKind",
  "KEY_PROJ",
  "LETTER_DESCRIPTIONS",
  "Letter",
  "ParamSpec",
  "QUERY_PROJ",
  "VALUE_PROJ",
  "attend",
  "auto_backend",
  "diff_attention",
  "effective_num_pseudo",
  "for_letter",
  "get",
  "iha_attention",
  "implementation_names",
  "implementations",
  "lookup",
  "mha_attention",
  "mixing_params",
  "names",
  "pha_attention",
  "project",
  "project_out",
  "project_qkv",
  "register",
  "registry",
  "resolve",
  "simplicial_attention",
  "talking_heads_attention",
  "unregister",
]
