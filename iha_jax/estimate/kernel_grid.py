"""What a Pallas TPU kernel's grid does, counted from the kernel itself (no hardware).

`kernel_calls(fn, *args)` traces `fn` and, for every compiled Pallas call in it (forward
and backward alike, inside `jit`, `shard_map`, custom VJPs), evaluates with NumPy, over
every grid step each TensorCore runs:
- the predicate of every `pl.when` (a `cond` whose false branch is empty), in source
  order and nested as in the source: how many steps run its body. Predicates read
  program ids, grid sizes and scalar-prefetch operands whose values are known when
  tracing (splash attention's mask tables are constants); a predicate that reads
  anything else counts as true on every step (`KernelCall.weighted` is then False);
- every BlockSpec's index map: a block is copied between HBM and VMEM at a step whose
  block index differs from the previous step's (Pallas' pipeline skips the copy when it
  repeats), so `dma_bytes` is what the block copies move in all.
Megacore chips (v5p) split a grid's first "parallel" dimension of size > 1 over their two
TensorCores, contiguously; other chips run the whole grid on one core.

Reads `jax.core` jaxprs and the `pallas_call` equation's public parameters
(`grid_mapping`, `compiler_params`, `name`); nothing here runs a kernel.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jax_core

_SCALAR_OPS: dict[str, Callable[..., Any]] = {
  "add": np.add,
  "sub": np.subtract,
  "mul": np.multiply,
  "max": np.maximum,
  "min": np.minimum,
  "neg": np.negative,
  "abs": np.abs,
  "sign": np.sign,
  "lt": np.less,
  "le": np.less_equal,
  "gt": np.greater,
  "ge": np.greater_equal,
  "eq": np.equal,
  "ne": np.not_equal,
  "and": lambda a, b: np.bitwise_and(a, b) if _is_int(a, b) else np.logical_and(a, b),
  "or": lambda a, b: np.bitwise_or(a, b) if _is_int(a, b) else np.logical_or(a, b),
  "xor": lambda a, b: np.bitwise_xor(a, b) if _is_int(a, b) else np.logical_xor(a, b),
  "not": lambda a: np.invert(a) if _is_int(a) else np.logical_not(a),
  "div": lambda a, b: np.trunc(np.divide(a, b)).astype(np.result_type(a, b)),  # C-style
  "rem": np.fmod,
  "shift_left": np.left_shift,
  "shift_right_arithmetic": np.right_shift,
  "clamp": lambda lo, x, hi: np.clip(x, lo, hi),
  "select_n": lambda which, *cases: np.choose(np.asarray(which).astype(np.int64), cases),
}
_PASS_THROUGH = ("squeeze", "reshape", "broadcast_in_dim", "copy", "copy_p", "optimization_barrier")
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "run_scoped")


def _is_int(*values) -> bool:
  return all(np.issubdtype(np.asarray(v).dtype, np.integer) for v in values)


@dataclasses.dataclass
class When:
  """One `pl.when` body: the grid steps each core runs it on (nested bodies count within
  their parent's steps), the `pl.when`s inside it, and the MXU work one run of its own
  body does (`mxu_work`, nested bodies not included)."""

  steps: tuple[int, ...]
  children: list[When] = dataclasses.field(default_factory=list)
  mxu_work: MxuWork | None = None


@dataclasses.dataclass(frozen=True)
class MxuWork:
  """The matrix products a kernel body issues, as (batch * rows, contraction, columns)
  per product (loops with a static trip count repeat theirs; products under a `pl.when`
  belong to that body). `flops(edge)`: their FLOPs with the contraction and the columns
  padded to the MXU's edge (128 on v5e/v5p, 256 on v6e) and rows to 8: an MXU pass takes
  a whole edge however few of its lanes a product fills."""

  products: tuple[tuple[int, int, int, float], ...] = ()  # (rows, contraction, cols, times)

  def flops(self, edge: int) -> float:
    return sum(self.flops_by_product(edge).values())

  def flops_by_product(self, edge: int) -> dict[tuple[int, int, int], float]:
    """`flops` per product shape (rows, contraction, columns as issued, unpadded)."""
    pad = lambda x, m: -(-x // m) * m
    out: collections.Counter = collections.Counter()
    for r, k, c, t in self.products:
      out[(r, k, c)] += 2.0 * pad(r, 8) * pad(k, edge) * pad(c, edge) * t
    return out


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One Pallas TPU call as traced.

  `input_shapes`: its operands' shapes (scalar prefetch first), to find its compiled
  program. `core_steps`: grid steps per TensorCore. `whens`: its top-level `pl.when`s.
  `dma_bytes`: HBM<->VMEM block copies over the whole grid (all cores)."""

  name: str
  grid: tuple[int, ...]
  semantics: tuple[str, ...]
  input_shapes: tuple[tuple[int, ...], ...]
  core_steps: tuple[int, ...]
  whens: tuple[When, ...]
  dma_bytes: int
  weighted: bool
  mxu_work: MxuWork = MxuWork()  # per grid step, outside every `pl.when`


def kernel_calls(fn: Callable, *args: Any, cores: int = 1) -> list[KernelCall]:
  """The compiled (not interpreted) Pallas calls `fn(*args)` makes, in trace order, as
  run on a chip with `cores` TensorCores (2: v5p's megacore)."""
  return kernel_calls_in(jax.make_jaxpr(fn)(*args), cores=cores)


def kernel_calls_in(closed: jax_core.ClosedJaxpr, cores: int = 1) -> list[KernelCall]:
  """`kernel_calls` of a traced program (`jax.jit(f).trace(...).jaxpr`)."""
  known = {var: np.asarray(value) for var, value in zip(closed.jaxpr.constvars, closed.consts)}
  calls: list[KernelCall] = []
  _find(closed.jaxpr, known, calls, cores)
  return calls


def _sub_jaxprs(params: dict[str, Any]):
  """(jaxpr, consts) of each sub-jaxpr an equation carries."""
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        yield inner, getattr(item, "consts", ())


def _find(jaxpr, known: dict, calls: list[KernelCall], cores: int) -> dict:
  """Appends the Pallas calls in `jaxpr` to `calls`; returns `known` extended with the
  values known at its equations' outputs (constants passed through calls, such as splash
  attention's mask tables saved by a forward pass for its backward)."""
  known = dict(known)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      if not eqn.params.get("interpret"):
        calls.append(_analyse(eqn, [_known(v, known) for v in eqn.invars], cores))
      continue
    subs = list(_sub_jaxprs(eqn.params))
    if not subs:
      _fold(eqn, known)
      continue
    # A cond's branches take its operands after the branch index.
    outer_vars = eqn.invars[1:] if eqn.primitive.name == "cond" else eqn.invars
    for inner, consts in subs:
      inner_known = dict(zip(inner.constvars, (np.asarray(c) for c in consts)))
      if len(inner.invars) == len(outer_vars):
        for outer, var in zip(outer_vars, inner.invars):
          value = _known(outer, known)
          if value is not None:
            inner_known[var] = value
      inner_known = _find(inner, inner_known, calls, cores)
      if len(inner.outvars) == len(eqn.outvars):
        for outer, var in zip(eqn.outvars, inner.outvars):
          value = _known(var, inner_known)
          if value is not None and outer not in known:
            known[outer] = value
  return known


_FOLD_LIMIT = 1 << 22  # elements: mask tables, never activations


def _fold(eqn, known: dict) -> None:
  """Constant folding: an equation whose inputs are all known (and whose outputs are
  small) is evaluated, so tables reshaped or broadcast on their way to a kernel (vmap
  batches a kernel's saved mask tables) stay known."""
  inputs = [_known(v, known) for v in eqn.invars]
  if any(x is None for x in inputs) or not eqn.outvars:
    return
  if any(math.prod(getattr(v.aval, "shape", ())) > _FOLD_LIMIT for v in eqn.outvars):
    return
  try:
    with jax.ensure_compile_time_eval():
      out = eqn.primitive.bind(*inputs, **eqn.params)
  except Exception:  # an op that cannot run eagerly here: its outputs stay unknown
    return
  outs = out if eqn.primitive.multiple_results else [out]
  for var, value in zip(eqn.outvars, outs):
    known[var] = np.asarray(value)


def _known(var, env: dict):
  if isinstance(var, jax_core.Literal):
    return np.asarray(var.val)
  return env.get(var)


def _core_grids(grid: tuple[int, ...], semantics: Sequence[str], cores: int):
  """Per core: the grid-index arrays of its steps in execution order (row-major)."""
  split = next(
    (i for i, (size, kind) in enumerate(zip(grid, semantics)) if kind == "parallel" and size > 1),
    None,
  )
  if cores == 1 or split is None:
    ranges = [[range(n) for n in grid]]
  else:
    share = -(-grid[split] // cores)
    ranges = []
    for core in range(cores):
      dims = [range(n) for n in grid]
      dims[split] = range(core * share, min(grid[split], (core + 1) * share))
      ranges.append(dims)
  for dims in ranges:
    mesh = np.meshgrid(*[np.asarray(d, np.int64) for d in dims], indexing="ij")
    yield [m.reshape(-1) for m in mesh]


def _analyse(eqn, operands: list, cores: int) -> KernelCall:
  mapping = eqn.params["grid_mapping"]
  grid = tuple(int(n) for n in mapping.grid)
  params = eqn.params.get("compiler_params")
  semantics = getattr(params, "dimension_semantics", None)
  if isinstance(params, dict):  # older jax: {"mosaic": {...}}
    semantics = params.get("mosaic", {}).get("dimension_semantics")
  semantics = tuple(
    str(s).split(".")[-1].lower() for s in (semantics or ("arbitrary",) * len(grid))
  )
  prefetch = operands[: mapping.num_index_operands]
  kernel = eqn.params["jaxpr"]
  core_steps, per_core_whens, dma_bytes, weighted = [], [], 0, True
  for indices in _core_grids(grid, semantics, cores):
    steps = len(indices[0]) if indices else 1
    core_steps.append(steps)
    env = {var: value for var, value in zip(kernel.invars, prefetch) if value is not None}
    whens: list[When] = []
    weighted &= _eval(kernel, env, indices, grid, np.ones(steps, bool), whens)
    per_core_whens.append(whens)
    dma_bytes += _block_copy_bytes(mapping, indices, prefetch, steps)
  name = eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "")
  whens = _merge(per_core_whens)
  _attach_mxu_work(kernel, whens)
  return KernelCall(
    name=str(name),
    grid=grid,
    semantics=semantics,
    input_shapes=tuple(tuple(v.aval.shape) for v in eqn.invars),
    core_steps=tuple(core_steps),
    whens=tuple(whens),
    dma_bytes=dma_bytes,
    weighted=weighted,
    mxu_work=mxu_work(kernel),
  )


def mxu_work(jaxpr, times: float = 1.0) -> MxuWork:
  """The products `jaxpr` issues outside its `pl.when`s (conds), loops of static trips
  repeated (`scan`'s length; a `while` counts once: a floor)."""
  products: list[tuple[int, int, int, float]] = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      products.append((*_product_shape(eqn), times))
    elif name == "cond":
      continue
    elif name == "scan":
      products += mxu_work(eqn.params["jaxpr"].jaxpr, times * eqn.params["length"]).products
    else:
      for inner, _ in _sub_jaxprs(eqn.params):
        products += mxu_work(inner, times).products
  return MxuWork(tuple(products))


def _product_shape(eqn) -> tuple[int, int, int]:
  """(batch * rows, contraction, columns) of a dot_general."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
  lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  batch = math.prod(lhs[i] for i in lhs_batch)
  contraction = math.prod(lhs[i] for i in lhs_contract)
  rows = math.prod(x for i, x in enumerate(lhs) if i not in (*lhs_contract, *lhs_batch))
  cols = math.prod(x for i, x in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch))
  return batch * rows, contraction, cols


def _attach_mxu_work(jaxpr, whens: list[When]) -> None:
  """Sets each `When`'s `mxu_work` from the `pl.when` bodies of `jaxpr`, found in the
  order `_eval` found them (calls entered in place)."""
  bodies = list(_when_bodies(jaxpr))
  if len(bodies) != len(whens):
    return
  for body, when in zip(bodies, whens):
    when.mxu_work = mxu_work(body)
    _attach_mxu_work(body, when.children)


def _when_bodies(jaxpr):
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "cond":
      branches = eqn.params["branches"]
      if len(branches) == 2 and not branches[0].jaxpr.eqns:
        yield branches[-1].jaxpr
    elif name in _CALLS:
      inner = next((j for j, _ in _sub_jaxprs(eqn.params)), None)
      if inner is not None:
        yield from _when_bodies(inner)


def _merge(per_core: list[list[When]]) -> list[When]:
  """Per-core `When` trees (same shape) -> one tree with a count per core."""
  merged = []
  for nodes in zip(*per_core):
    merged.append(
      When(tuple(s for n in nodes for s in n.steps), _merge([list(n.children) for n in nodes]))
    )
  return merged


def _eval(jaxpr, env: dict, indices, grid, active: np.ndarray, whens: list[When]) -> bool:
  """Evaluates the scalar control flow of `jaxpr` over the steps in `indices` (arrays),
  appending each `pl.when`'s step count (among `active` steps) to `whens`. Returns False
  if some predicate could not be evaluated (it then counts as always true)."""
  complete = True
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    inputs = [_known(v, env) for v in eqn.invars]
    if name == "cond":
      branches = eqn.params["branches"]
      which = inputs[0]
      runs = active.copy() if which is None else active & (np.asarray(which) == len(branches) - 1)
      complete &= which is not None
      body = branches[-1].jaxpr
      inner = {v: x for v, x in zip(body.invars, inputs[1:]) if x is not None}
      node = When((int(runs.sum()),))
      complete &= _eval(body, inner, indices, grid, runs, node.children)
      if len(branches) == 2 and not branches[0].jaxpr.eqns:
        whens.append(node)
      else:  # an if/else: not a pl.when (its spans are not matched)
        complete = False
      continue
    if name in _CALLS:
      inner_jaxpr = next((j for j, _ in _sub_jaxprs(eqn.params)), None)
      if inner_jaxpr is not None and len(inner_jaxpr.invars) == len(inputs):
        inner = {v: x for v, x in zip(inner_jaxpr.invars, inputs) if x is not None}
        complete &= _eval(inner_jaxpr, inner, indices, grid, active, whens)
        for outer, var in zip(eqn.outvars, inner_jaxpr.outvars):
          value = _known(var, inner)
          if value is not None:
            env[outer] = value
      continue
    result = _scalar(eqn, name, inputs, indices, grid)
    if result is not None:
      env[eqn.outvars[0]] = result
  return complete


def _scalar(eqn, name: str, inputs: list, indices, grid):
  """The value of a scalar-valued equation over the steps, or None if unknown."""
  if len(eqn.outvars) != 1 or getattr(eqn.outvars[0].aval, "shape", None) != ():
    return None
  if name == "program_id":
    return indices[eqn.params["axis"]]
  if name == "num_programs":
    return np.asarray(grid[eqn.params["axis"]])
  if any(x is None for x in inputs):
    return None
  if name in ("get", "load"):
    transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], inputs[1:])
    if len(transforms) != 1 or not hasattr(transforms[0], "indices"):
      return None
    position = tuple(np.asarray(i) for i in transforms[0].indices)
    if any(not np.issubdtype(p.dtype, np.integer) for p in position):
      return None
    return np.asarray(inputs[0])[position]
  if name == "convert_element_type":
    return np.asarray(inputs[0]).astype(np.dtype(eqn.params["new_dtype"]))
  if name == "integer_pow":
    return np.power(inputs[0], eqn.params["y"])
  if name in _PASS_THROUGH:
    return np.asarray(inputs[0])
  if name in _SCALAR_OPS:
    return _SCALAR_OPS[name](*inputs)
  return None


def _block_shape(mapping) -> tuple[int, ...] | None:
  sizes = []
  for dim in mapping.block_shape:
    size = getattr(dim, "block_size", dim)
    sizes.append(1 if size is None or not isinstance(size, (int, np.integer)) else int(size))
  return tuple(sizes)


def _block_copy_bytes(grid_mapping, indices, prefetch: list, steps: int) -> int:
  """HBM<->VMEM bytes of every BlockSpec operand over this core's steps."""
  total = 0
  for mapping in grid_mapping.block_mappings:
    aval = mapping.array_aval
    space = str(getattr(mapping.transformed_block_aval, "memory_space", ""))
    if "any" in space.lower() or "smem" in space.lower() or "semaphore" in space.lower():
      continue
    block = _block_shape(mapping)
    index_jaxpr = mapping.index_map_jaxpr
    env = {var: value for var, value in zip(index_jaxpr.jaxpr.invars, [*indices, *prefetch])}
    env.update(
      (var, np.asarray(value))
      for var, value in zip(index_jaxpr.jaxpr.constvars, index_jaxpr.consts)
    )
    _eval(index_jaxpr.jaxpr, env, indices, (), np.ones(steps, bool), [])
    outputs = [_known(v, env) for v in index_jaxpr.jaxpr.outvars]
    copies = steps  # unknown index map: a copy per step (an upper bound)
    if all(o is not None for o in outputs) and steps:
      stacked = np.stack([np.broadcast_to(o, (steps,)) for o in outputs])
      copies = 1 + int(np.any(stacked[:, 1:] != stacked[:, :-1], axis=0).sum())
    total += copies * math.prod(block) * np.dtype(aval.dtype).itemsize
  return total
