"""Logical-axis rules: the ONE place mapping logical axis names to mesh axes.

Parameters and activations carry the logical names of `iha_jax.parallel.axes`;
activations are constrained with `flax.linen.with_logical_constraint` (a no-op without
rules and a mesh). Mesh axes:

- `data`: pure data parallelism (parameters replicated).
- `fsdp`: data parallelism with parameters and optimizer state sharded (ZeRO-3).
- `context`: context (sequence) parallelism: activations split along the tokens; the
  attention layers exchange source keys and values (`iha_jax.parallel.context`).
- `tensor`: tensor parallelism over attention heads and the MLP width.

IHA under tensor parallelism: the pseudo-head mixing contracts over SOURCE heads, so
each device needs all H source heads of q, k, v. The layers gather the small
`[B, N, H, d]` projections over `tensor` (`ACTIVATION_HEADS_SRC` -> replicated) and
shard the P-times larger pseudo-heads by TARGET head (`heads` of `alpha_*` -> tensor),
so no `[B, N, H, P, d]` tensor is ever communicated.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from jax.sharding import AxisType, PartitionSpec

from iha_jax.parallel.axes import (
  ACTIVATION_BATCH,
  ACTIVATION_EMBED,
  ACTIVATION_HEADS,
  ACTIVATION_HEADS_SRC,
  ACTIVATION_LENGTH,
  ACTIVATION_VOCAB,
  EMBED,
  FEATURES,
  HEAD_DIM,
  HEADS,
  HEADS_DST,
  HEADS_SRC,
  MLP,
  OUTPUTS,
  PSEUDO,
  QK_PAIR,
  VOCAB,
)

DATA, FSDP, CONTEXT, TENSOR = "data", "fsdp", "context", "tensor"
# Outermost first: tensor (most traffic) innermost, then context, as MaxText orders them.
MESH_AXES = (DATA, FSDP, CONTEXT, TENSOR)
# A mesh config may leave these out (size 1): configs and checkpoints from before them.
OPTIONAL_AXES = {CONTEXT: 1}
BATCH_AXES = (DATA, FSDP)

LogicalRules = tuple[tuple[str, Any], ...]

LOGICAL_AXIS_RULES: LogicalRules = (
  # Parameters (names: iha_jax.parallel.axes).
  (EMBED, FSDP),  # model width D: FSDP shards every [D, ...] matrix.
  (HEADS, TENSOR),  # projection heads and IHA target heads.
  (MLP, TENSOR),  # MLP hidden width F.
  (VOCAB, TENSOR),  # embedding rows / output head columns.
  (HEAD_DIM, None),
  (HEADS_SRC, None),  # alpha_* / talk_* source axis: contracted, kept whole.
  (HEADS_DST, None),  # full collapse output head: tiny, replicated.
  (PSEUDO, None),
  (QK_PAIR, None),  # differential attention's two query/key maps.
  (OUTPUTS, None),  # per-token output head (encoders): small, replicated.
  (FEATURES, None),  # input features F of `input_proj: [F, D]`: few, kept whole.
  # Activations.
  (ACTIVATION_BATCH, BATCH_AXES),
  (ACTIVATION_LENGTH, CONTEXT),
  (ACTIVATION_EMBED, None),
  (ACTIVATION_HEADS, TENSOR),
  (ACTIVATION_HEADS_SRC, None),  # q/k/v gathered before IHA mixing (see module doc).
  (ACTIVATION_VOCAB, TENSOR),
)

_RULES = dict(LOGICAL_AXIS_RULES)


def logical_to_mesh_spec(logical: PartitionSpec | None) -> PartitionSpec:
  """`PartitionSpec` of logical names -> `PartitionSpec` of mesh axes.

  A mesh axis is used at most once per array: a later dimension whose rule names an
  axis already taken stays unsharded (e.g. `heads` and `mlp` both on `tensor`).

  Raises:
    ValueError: for a logical name without a rule.
  """
  if logical is None:
    return PartitionSpec()
  used: set[str] = set()
  out = []
  for name in logical:
    if name is None:
      out.append(None)
      continue
    if name not in _RULES:
      raise ValueError(
        f"logical axis {name!r} has no rule in iha_jax/parallel/rules.py; known: {sorted(_RULES)}"
      )
    axes = _RULES[name]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)


def free_mesh_axes(mesh: Any, logical: str) -> tuple[str, ...]:
  """The mesh axes the active logical-axis rules (the project's when none are active) map
  `logical` to, kept to those `mesh` has and is not already inside a `shard_map` over."""
  free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
  (axes,) = nn.logical_to_mesh_axes((logical,), nn.get_logical_axis_rules() or LOGICAL_AXIS_RULES)
  return tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in free)
