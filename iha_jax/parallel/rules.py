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

from collections.abc import Mapping
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
  KV_HEADS,
  MLP,
  OUTPUTS,
  PSEUDO,
  QK_PAIR,
  VOCAB,
)

DATA, FSDP, CONTEXT, TENSOR = "data", "fsdp", "context", "tensor"
# Outermost first: tensor (most traffic) innermost, then context, as MaxText orders them.
MESH_AXES = (DATA, FSDP, CONTEXT, TENSOR)
BATCH_AXES = (DATA, FSDP)

LogicalRules = tuple[tuple[str, Any], ...]

LOGICAL_AXIS_RULES: LogicalRules = (
  # Parameters (names: iha_jax.parallel.axes).
  (EMBED, FSDP),  # model width D: FSDP shards every [D, ...] matrix.
  (HEADS, TENSOR),  # projection heads and IHA target heads.
  (KV_HEADS, TENSOR),  # key/value heads: split where the axis divides G, else whole.
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

# The roles a mesh of your own maps its axes to (`logical_rules`; docs/your_model.md): each
# stands for the logical axes that the project's mesh axis of that role takes above.
ROLES: dict[str, tuple[str, ...]] = {
  "batch": (ACTIVATION_BATCH,),  # data parallelism: the batch's rows (data, fsdp)
  "embed": (EMBED,),  # FSDP: every parameter's model-width axis D (fsdp)
  "heads": (HEADS, KV_HEADS, MLP, VOCAB, ACTIVATION_HEADS, ACTIVATION_VOCAB),  # tensor parallel
  "length": (ACTIVATION_LENGTH,),  # context parallelism: the tokens (context)
}


def _axes(value: Any) -> tuple[str, ...]:
  """A rule's mesh axes: None, one name, or a sequence of names -> a tuple of names."""
  return (value,) if isinstance(value, str) else tuple(value or ())


def logical_rules(mapping: Mapping[str, Any], mesh: Any | None = None) -> LogicalRules:
  """Logical-axis rules for a mesh of your own, from a few roles.

  Args:
    mapping: `{role or logical axis: mesh axes}`, e.g. `{"batch": "dp", "heads": "tp"}`
      or `{"batch": ("replica", "dp")}`; roles (`ROLES`): "batch" (data parallelism),
      "embed" (parameters' D, FSDP), "heads" (heads, MLP width and vocabulary: tensor
      parallelism), "length" (the sequence: context parallelism); a logical axis name of
      `iha_jax.parallel.axes` (e.g. `"mlp": None`) overrides what its role gave it. Roles
      left out, and every other logical axis, stay unsharded (size one).
    mesh: when given, every mesh axis named must be one of its axes.

  Returns:
    rules for every logical axis of the project, for `activate(mesh, rules)`,
    `flax.linen.logical_axis_rules` or `named_shardings`.

  Raises:
    ValueError: in one line, for an unknown role or logical axis, or an axis the mesh
      does not have.
  """
  rules = dict.fromkeys(_RULES)
  for key, value in mapping.items():
    if key not in ROLES and key not in _RULES:
      raise ValueError(
        f"logical_rules: {key!r} is neither a role {tuple(ROLES)} nor a logical axis "
        f"({', '.join(sorted(_RULES))})"
      )
    if mesh is not None:
      check_rules(((key, value),), mesh)  # names the key as given
    if key in ROLES:
      rules.update(dict.fromkeys(ROLES[key], _axes(value) or None))
  for key, value in mapping.items():
    if key in _RULES and key not in ROLES:
      rules[key] = _axes(value) or None
  out = tuple(rules.items())
  if mesh is not None:
    check_rules(out, mesh)
  return out


def check_rules(rules: LogicalRules, mesh: Any) -> None:
  """Raises ValueError in one line naming the first rule whose mesh axis `mesh` lacks."""
  names = tuple(mesh.axis_names)
  for logical, value in rules:
    for axis in _axes(value):
      if axis not in names:
        raise ValueError(
          f"logical-axis rule {logical!r} -> {axis!r}: the mesh has no axis {axis!r} (its "
          f"axes: {', '.join(names) or 'none'}); name one of them, or leave the role out "
          "(size one)"
        )


def rules_for(mesh: Any, rules: Mapping[str, Any] | LogicalRules | None = None) -> LogicalRules:
  """The rules to use on `mesh`: `rules` checked against it (a mapping goes through
  `logical_rules`), or, None, the project's own with the mesh axes it lacks left out
  (those count as size one)."""
  if rules is None:
    names = set(mesh.axis_names)
    foreign = [
      axis
      for axis, size in zip(mesh.axis_names, mesh.axis_sizes)
      if axis not in MESH_AXES and size > 1
    ]
    if foreign:
      example = ", ".join(f"'{role}': '{axis}'" for role, axis in zip(("batch", "heads"), foreign))
      raise ValueError(
        f"mesh axes {tuple(foreign)} are not the project's {MESH_AXES}, and no rules say what "
        f"they shard: pass rules=iha_jax.parallel.logical_rules({{{example}}}, mesh) (roles "
        f"{tuple(ROLES)}; docs/your_model.md)"
      )
    if all(set(_axes(value)) <= names for _, value in LOGICAL_AXIS_RULES):
      return LOGICAL_AXIS_RULES
    kept = lambda value: tuple(a for a in _axes(value) if a in names) or None
    return tuple((logical, kept(value)) for logical, value in LOGICAL_AXIS_RULES)
  if isinstance(rules, Mapping):
    return logical_rules(rules, mesh)
  rules = tuple((logical, value) for logical, value in rules)
  check_rules(rules, mesh)
  return rules


def logical_to_mesh_spec(
  logical: PartitionSpec | None, rules: LogicalRules | None = None
) -> PartitionSpec:
  """`PartitionSpec` of logical names -> `PartitionSpec` of mesh axes, by `rules` (default:
  the project's, `LOGICAL_AXIS_RULES`).

  A mesh axis is used at most once per array: a later dimension whose rule names an
  axis already taken stays unsharded (e.g. `heads` and `mlp` both on `tensor`).

  Raises:
    ValueError: for a logical name without a rule.
  """
  if logical is None:
    return PartitionSpec()
  table = _RULES if rules is None else dict(rules)
  used: set[str] = set()
  out = []
  for name in logical:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise ValueError(
        f"logical axis {name!r} has no rule in iha_jax/parallel/rules.py; known: {sorted(table)}"
      )
    axes = table[name]
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
