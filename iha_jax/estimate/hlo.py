"""The optimized HLO of a compiled program, read as text: computations, their scheduled
instruction order, shapes in bytes, and the device groups of collectives.

`compiled.as_text()` of a TPU compile is the program XLA scheduled (`is_scheduled=true`):
each computation lists its instructions in the order they issue, so an asynchronous
collective's `*-start` ... `*-done` span shows the work scheduled to hide it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# Bytes per element of the HLO element types a training step uses (also `llo`'s).
ELEMENT_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(ELEMENT_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")

# The collectives' opcodes (synchronous, or the `-start` of an asynchronous pair).
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # the result's shape text, e.g. "bf16[512,4096]{1,0:T(8,128)}" or a tuple
  opcode: str
  operands: tuple[str, ...]
  attributes: str  # everything after the operand list

  def called(self) -> dict[str, str]:
    """Computations it calls by role: `calls`, `body`, `condition`, `to_apply`."""
    return dict(_CALLED.findall(self.attributes))

  def branches(self) -> tuple[str, ...]:
    found = _BRANCHES.search(self.attributes)
    return tuple(re.findall(r"%([\w.\-]+)", found.group(1))) if found else ()


@dataclasses.dataclass(frozen=True)
class Module:
  computations: dict[str, tuple[Instruction, ...]]
  entry: str

  def shapes(self, computation: str) -> dict[str, str]:
    return {i.name: i.shape for i in self.computations[computation]}


def parse(text: str) -> Module:
  """The computations of an HLO module's text, instructions in their listed order."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and "=" not in line.split("(")[0]:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
      continue
    found = _INSTRUCTION.match(line) if current else None
    if found:
      computations[current].append(_instruction(found.group(2), found.group(3)))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return Module({k: tuple(v) for k, v in computations.items()}, entry)


def _instruction(name: str, rest: str) -> Instruction:
  shape, rest = _split_shape(rest)
  opcode = re.match(r"([a-z][\w\-]*)\(", rest)
  if opcode is None:  # e.g. a constant's literal: no operands worth reading
    return Instruction(name, shape, rest.split("(")[0].strip(), (), "")
  close = _closing(rest, opcode.end() - 1)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[opcode.end() : close]))
  return Instruction(name, shape, opcode.group(1), operands, rest[close + 1 :])


def _split_shape(text: str) -> tuple[str, str]:
  """(shape, the rest): the shape ends at the first space outside brackets."""
  depth = 0
  for i, char in enumerate(text):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    elif char == " " and depth == 0:
      return text[:i], text[i + 1 :]
  return text, ""


def _closing(text: str, open_index: int) -> int:
  """The index of the bracket closing the one at `open_index` (`(` or `{`)."""
  opening = text[open_index]
  closing = {"(": ")", "{": "}"}[opening]
  depth = 0
  for i in range(open_index, len(text)):
    depth += (text[i] == opening) - (text[i] == closing)
    if depth == 0:
      return i
  return len(text)


def shape_bytes(shape: str) -> float:
  """The bytes of every array in a shape's text (a tuple's elements summed), logical
  sizes (no tiling padding)."""
  return float(
    sum(
      ELEMENT_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      for dtype, dims in _ARRAY.findall(shape)  # layouts hold no `type[dims]`
    )
  )


def replica_groups(attributes: str, num_devices: int) -> list[list[int]] | None:
  """The device groups of a collective (logical device ids, indices into the program's
  device assignment), from any of XLA's spellings: `{{0,1},{2,3}}`, the iota form
  `[2,2]<=[4]` / `[2,2]<=[2,2]T(1,0)`, the mesh form `mesh['a'=2,'b'=2] {'b'}`, or `{}`
  (every device). None: a spelling this reader does not know."""
  found = re.search(r"replica_groups=(.*)", attributes)
  if found is None:
    return None
  text = found.group(1)
  if text.startswith("{}"):
    return [list(range(num_devices))]
  if text.startswith("{{"):
    body = text[1 : _closing(text, 0)]
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^}]*)\}", body)]
  iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  if iota:
    shape = [int(x) for x in iota.group(1).split(",")]
    ids = _iota(iota.group(2), iota.group(3))
    return ids.reshape(shape).tolist()
  mesh = re.match(r"mesh\[([^\]]*)\](?:\s*<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", text)
  if mesh:
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    sizes = [int(size) for _, size in axes]
    names = [name for name, _ in axes]
    ids = _iota(mesh.group(2), mesh.group(3)) if mesh.group(2) else np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    grouped = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(4))]
    others = [i for i in range(len(sizes)) if i not in grouped]
    moved = np.transpose(ids, others + grouped)
    return moved.reshape(-1, math.prod(sizes[i] for i in grouped) if grouped else 1).tolist()
  return None


def _iota(dims: str, permutation: str | None) -> np.ndarray:
  shape = [int(x) for x in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  if permutation:
    ids = np.transpose(ids, [int(x) for x in permutation.split(",")])
  return ids.reshape(-1)


def source_target_pairs(attributes: str) -> list[tuple[int, int]]:
  found = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
  return (
    [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", found.group(1))] if found else []
  )
