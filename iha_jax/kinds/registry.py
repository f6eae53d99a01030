"""The registered attention kinds: their records, schedule letters and implementations,
"auto", and `attend`, the one checked call of every kind's entry point and layer.

`register(record)` adds a kind (`AttentionKind`), its letters (`TransformerConfig`'s
schedule) and its implementations; the built-ins register when `iha_jax.kinds` is
imported. `attend(kind, *arrays, options=...)` runs the record's array checks and the
shared options checks, resolves "auto" (`resolve`), looks the implementation up
(`lookup`: context-parallel on a mesh with a `context` axis) and calls it. Every
implementation of a kind takes the kind's arrays, then the checked `AttentionOptions`, and
computes the same function; kernels run inside `shard_map` when a mesh is current
(`iha_jax.kernels.sharded`). The layers make this one call too (`iha_jax.nn.call`).

| kind | entry point | implementations |
| --- | --- | --- |
| iha | `iha_attention` | reference, xla, pallas_tpu, pallas_tpu_window (windows), pallas_gpu, |
| | | pallas_gpu_window (windows), pallas_gpu_mha, cudnn, splash |
| mha | `mha_attention` | reference, xla, pallas_tpu, pallas_gpu (= pallas_gpu_mha), cudnn, splash |
| talking_heads | `talking_heads_attention` | reference, xla |
| diff | `diff_attention` | reference, xla, pallas_tpu, pallas_gpu(_mha), splash (via mha) |
| simplicial | `simplicial_attention` | reference, xla |
| pha | `pha_attention` | reference, xla, pallas_tpu, pallas_gpu (= pallas_gpu_mha), cudnn, |
| | | splash (all through mha) |
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Unpack

import jax

from iha_jax.core import cudnn_attention, validation
from iha_jax.core.options import AttentionOptions, OptionFields, with_overrides
from iha_jax.kernels.window import tpu as tpu_window
from iha_jax.kinds import tpu_auto
from iha_jax.kinds.base import AttentionKind, Letter
from iha_jax.parallel import context

_KINDS: dict[str, AttentionKind] = {}
_LETTERS: dict[str, tuple[str, Letter]] = {}  # letter -> (kind name, Letter)
_DESCRIPTIONS: dict[str, str] = {}

# Letter -> description, live (kinds registered later appear too).
LETTER_DESCRIPTIONS = types.MappingProxyType(_DESCRIPTIONS)

AUTO = "auto"
# Implementations that take queries sliced from a longer key sequence
# (`AttentionOptions.query_offset`, `kv_segment_ids`, `kv_positions`): the ones a
# context-parallel call (`iha_jax.parallel.context`) can run on each shard. The Pallas
# kernels take the offset as a scalar operand (one compiled kernel for every shard) and
# visit only the key tiles a shard's queries see; cuDNN's attention does not (its packed
# layout is private to jax), so "auto" skips it under a context axis.
SLICED = frozenset(
  "reference xla pallas_tpu pallas_tpu_window pallas_gpu pallas_gpu_window pallas_gpu_mha".split()
)


# --- the kinds and their letters ----------------------------------------------------------


def register(record: AttentionKind) -> AttentionKind:
  """Adds `record` (an `AttentionKind` instance) and returns it.

  Raises ValueError when its name or one of its letters is taken by another kind, a
  letter is not a single upper-case character, or its implementations lack "reference"
  and "xla" or name "auto"; TypeError when an implementation is not a callable.
  """
  if not isinstance(record, AttentionKind):
    raise TypeError(f"register takes an AttentionKind instance, got {record!r}")
  name = record.name
  if name in _KINDS and _KINDS[name] is not record:
    raise ValueError(f"attention kind {name!r} is already registered ({_KINDS[name]!r})")
  for letter in record.letters:
    if len(letter.letter) != 1 or not letter.letter.isupper():
      raise ValueError(f"{name}: a schedule letter is one upper-case character, got {letter!r}")
    owner = _LETTERS.get(letter.letter, (name,))[0]
    if owner != name:
      raise ValueError(f"{name}: schedule letter {letter.letter!r} belongs to kind {owner!r}")
  table = record.implementations
  if "reference" not in table or "xla" not in table or AUTO in table:
    raise ValueError(
      f"{name}: implementations must include 'reference' and 'xla' and not name {AUTO!r} "
      f"(it resolves among them), got {sorted(table)}"
    )
  for implementation, fn in {**table, **record.probability_implementations}.items():
    if not callable(fn):
      raise TypeError(
        f"{name}: implementation {implementation!r} must be a callable (the kind's arrays, "
        f"then AttentionOptions), got {fn!r}"
      )
  _KINDS[name] = record
  for letter in record.letters:
    _LETTERS[letter.letter] = (name, letter)
    _DESCRIPTIONS[letter.letter] = letter.description
  return record


def unregister(name: str) -> None:
  """Removes kind `name` and its letters (one a test or an experiment registered)."""
  record = get(name)
  for letter in record.letters:
    _LETTERS.pop(letter.letter, None)
    _DESCRIPTIONS.pop(letter.letter, None)
  del _KINDS[name]


def names() -> tuple[str, ...]:
  """The registered kinds, in registration order."""
  return tuple(_KINDS)


def get(name: str) -> AttentionKind:
  """The record of kind `name`; ValueError naming the registered kinds otherwise."""
  try:
    return _KINDS[name]
  except (KeyError, TypeError):
    raise ValueError(f"kind must be one of {names()}, got {name!r}") from None


def for_letter(letter: str) -> tuple[AttentionKind, Letter]:
  """(record, Letter) of schedule letter `letter`; ValueError listing the letters."""
  if letter not in _LETTERS:
    raise ValueError(f"letter must be one of {tuple(_LETTERS)}, got {letter!r}")
  name, spec = _LETTERS[letter]
  return _KINDS[name], spec


def mixing_params() -> tuple[str, ...]:
  """Names of every registered kind's identity-initialised head mixings."""
  return tuple(dict.fromkeys(n for record in _KINDS.values() for n in record.mixing_params))


def kind_fields() -> tuple[str, ...]:
  """`AttentionConfig` fields that only some kinds read (each kind's `config_fields`)."""
  return tuple(dict.fromkeys(n for record in _KINDS.values() for n in record.config_fields))


# --- implementations and "auto" ----------------------------------------------------------


def _record(kind: str | AttentionKind) -> AttentionKind:
  return get(kind.name if isinstance(kind, AttentionKind) else kind)


def implementations(kind: str | AttentionKind) -> tuple[str, ...]:
  """The concrete implementations of `kind` (without "auto")."""
  return tuple(_record(kind).implementations)


def implementation_names() -> tuple[str, ...]:
  """Every implementation name of the registered kinds, then "auto"."""
  found = (name for record in _KINDS.values() for name in record.implementations)
  return (*dict.fromkeys(found), AUTO)


def check_implementation_name(implementation: Any) -> None:
  """Raises ValueError unless `implementation` names an implementation of some registered
  kind, or "auto"."""
  if implementation not in implementation_names():
    raise ValueError(
      f"implementation must be one of {implementation_names()}, got {implementation!r}"
    )


_AUTO_BACKEND = contextvars.ContextVar[str | None]("iha_auto_backend", default=None)


@contextlib.contextmanager
def auto_backend(backend: str) -> Iterator[None]:
  """Resolves "auto" as on `backend` ("tpu", "gpu", "cpu") inside the block (programs
  lowered here for another platform: compile-only targets)."""
  token = _AUTO_BACKEND.set(backend)
  try:
    yield
  finally:
    _AUTO_BACKEND.reset(token)


# "auto" materialises IHA's pseudo q/k/v (P times q, k and v) only below this many bytes
# per device for one call: a model saves them per layer for its backward pass, which the
# paper's 2.4B step at P = 20 could not afford on an H100 (docs/performance.md §12, §14).
MATERIALISE_LIMIT_BYTES = 2**30


def _devices_sharing() -> int:
  """Devices the traced arrays are split over: the current mesh's non-manual axes."""
  mesh, manual = jax.sharding.get_abstract_mesh(), jax.sharding.AxisType.Manual
  return math.prod(size for size, kind in zip(mesh.axis_sizes, mesh.axis_types) if kind != manual)


def materialised_bytes(q, v, num_pseudo: int) -> int:
  """Bytes per device of the q, k and v a call materialises `num_pseudo` (P) times: q
  `[B, N, H, d]`, k `[B, N, G, d]` and v `[B, N, G, dv]` (G key/value heads, from v)."""
  k_size = v.size // v.shape[-1] * q.shape[-1]
  return num_pseudo * (q.size + k_size + v.size) * q.dtype.itemsize // _devices_sharing()


def resolve(
  kind: str | AttentionKind,
  implementation: str,
  q=None,
  v=None,
  options=None,
  num_pseudo: int = 1,
  *,
  sliced: bool = False,
  new_tokens: int | None = None,
  probabilities: bool = False,
) -> str:
  """The implementation a call of `kind` runs: `implementation` itself (checked to be the
  kind's), or for "auto" the fastest measured on the current backend (or `auto_backend`'s)
  for the call's `q`, `v`, `options` and P (`num_pseudo`):
  - one new token of a cached call (`new_tokens == 1`): "xla" (no tiles for P query rows);
  - GPU: cuDNN where `cudnn_attention.unsupported` finds nothing, unless the call is
    `sliced` (a sequence shard, which only `SLICED` implementations take); else a kind's
    own "pallas_gpu_mha" (IHA: materialised pseudo q/k/v + the Pallas MHA kernel); IHA
    takes either only within `MATERIALISE_LIMIT_BYTES` (`materialised_bytes`); else
    "pallas_gpu", which ran within noise of "pallas_gpu_mha" on an H200 in window layers
    and faster in global ones, and saves one P-sized array for the backward, not four
    (docs/performance.md §12);
  - TPU: the ranking's fastest for the call's shape class (`tpu_auto.choose`) among the
    implementations that take the call (`tpu_window.unsupported`), else "pallas_tpu";
  - elsewhere, or where a kind has none of these: "xla".
  `probabilities` (attention maps): "xla", the kind's `probability_implementations`
  (ValueError for a kind without them).
  """
  record = _record(kind)
  check_implementation_name(implementation)
  if probabilities:
    if "xla" not in record.probability_implementations:
      raise ValueError(
        f"{record.name} attention has no attention probabilities (its record names no "
        "probability_implementations); IHA, MHA and PHA layers return them"
      )
    return "xla"
  if implementation != AUTO:
    if implementation not in record.implementations:
      raise ValueError(
        f"{record.name} attention has no {implementation!r} implementation; "
        f"choose one of {implementations(record)} or {AUTO!r}"
      )
    return implementation
  if new_tokens == 1:
    return "xla"
  backend = _AUTO_BACKEND.get() or jax.default_backend()
  choice = None
  if backend == "gpu" and q is not None:
    choice = _auto_gpu(record, q, v, options, num_pseudo, sliced)
  if backend == "tpu":
    choice = _auto_tpu(record, q, v, options, num_pseudo, sliced)
  kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend)
  return choice or (kernel if kernel in record.implementations else "xla")


def _auto_gpu(record: AttentionKind, q, v, options, num_pseudo: int, sliced: bool) -> str | None:
  """`resolve`'s GPU choice before the Pallas kernels: cuDNN, or IHA's materialised path."""
  table = record.implementations
  small = num_pseudo == 1 or materialised_bytes(q, v, num_pseudo) <= MATERIALISE_LIMIT_BYTES
  cudnn = "cudnn" in table and not sliced
  if small and cudnn and cudnn_attention.unsupported(q, v, options) is None:
    return "cudnn"
  materialises = table.get("pallas_gpu_mha", table.get("pallas_gpu")) != table.get("pallas_gpu")
  return "pallas_gpu_mha" if small and materialises else None


def _auto_tpu(record: AttentionKind, q, v, options, num_pseudo: int, sliced: bool) -> str | None:
  """`resolve`'s TPU choice: the ranking's fastest implementation that takes the call."""
  small = (
    q is None or num_pseudo == 1 or materialised_bytes(q, v, num_pseudo) <= MATERIALISE_LIMIT_BYTES
  )
  windowed = options is not None and options.window is not None
  available = set(record.implementations)
  if "pallas_tpu_window" in available and (
    q is None or not windowed or tpu_window.unsupported(q, v, num_pseudo, options)
  ):
    available.discard("pallas_tpu_window")
  return tpu_auto.choose(record.name, num_pseudo, windowed, available, sliced=sliced, small=small)


# The Pallas kernels and the platform whose hardware runs them (elsewhere: the interpreter);
# "splash" is jax's own Pallas TPU kernel.
_KERNEL_PLATFORMS = {name: name.split("_")[1] for name in SLICED if name.startswith("pallas")}
_KERNEL_PLATFORMS["splash"] = "tpu"
_WARNED: set[str] = set()


def auto_backend_override() -> str | None:
  """The backend `auto_backend` names in the current context, or None."""
  return _AUTO_BACKEND.get()


def _warn_if_interpreted(implementation: str) -> None:
  """Warns once per implementation that an explicitly named Pallas kernel runs
  interpreted (its platform is not this process's backend, and no `auto_backend` target)."""
  platform = _KERNEL_PLATFORMS.get(implementation)
  if platform is None or implementation in _WARNED or _AUTO_BACKEND.get() is not None:
    return
  if jax.default_backend() == platform:
    return
  _WARNED.add(implementation)
  warnings.warn(
    f"implementation {implementation!r} runs in Pallas' interpreter on "
    f"{jax.default_backend()} (no {platform.upper()} here): correct but slow, for tests; "
    "'auto' picks the fastest code this backend runs",
    stacklevel=5,
  )


def lookup(
  kind: str | AttentionKind,
  implementation: str,
  q=None,
  v=None,
  options=None,
  num_pseudo: int = 1,
  *,
  new_tokens: int | None = None,
  probabilities: bool = False,
) -> Callable[..., jax.Array]:
  """The callable of `kind`'s `implementation`, `resolve`d from the call's facts given; it
  takes the kind's arrays and its `AttentionOptions`. On a mesh with a `context` axis
  (given `q`, whose length it divides) it runs the implementation context-parallel
  (`iha_jax.parallel.context.attend`) over the record's `sequence_roles`, "auto" then
  among `SLICED`. With `probabilities`, the kind's probability implementation, never split.
  """
  record = _record(kind)
  # A call whose queries already sit at an offset into longer keys (a cached call) runs
  # whole: it is not split over the context axis again.
  at_offset = options is not None and options.sliced
  sharded = not probabilities and q is not None and not at_offset and context.applies(q.shape[1])
  facts = dict(new_tokens=new_tokens, probabilities=probabilities)
  name = resolve(record, implementation, q, v, options, num_pseudo, sliced=sharded, **facts)
  if implementation != AUTO:
    _warn_if_interpreted(name)
  if probabilities:
    return record.probability_implementations[name]
  inner = record.implementations[name]
  if not sharded:
    return inner
  if record.sequence_roles is None:
    raise ValueError(
      f"{record.name} attention declares no sequence roles (AttentionKind.sequence_roles), "
      f"so it cannot run on a mesh with a 'context' axis; use context=1 for its layers"
    )
  if name not in SLICED:  # only an explicit name: "auto" resolved among SLICED
    raise ValueError(
      f"implementation {implementation!r} cannot run sequence-sharded (mesh axis "
      f"'context' > 1); use one of {sorted(SLICED & set(record.implementations))} or 'auto'"
    )

  def per_shard(*args: Any) -> jax.Array:  # each shard runs `name`, resolved here once
    *arrays, options = args
    return inner(*arrays, options.replace(implementation=name))

  return functools.partial(context.attend, per_shard, record.sequence_roles, num_pseudo=num_pseudo)


# --- the one checked call ----------------------------------------------------------------


def attend(
  kind: str | AttentionKind,
  *arrays: jax.Array,
  options: AttentionOptions | None = None,
  new_tokens: int | None = None,
  probabilities: bool = False,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """Checks and runs one call of `kind`: the work of every kind's entry point.

  Args:
    kind: a registered kind's name or record.
    *arrays: the kind's arrays, queries `[B, N, ...]` first, in the order its
      implementations take them.
    options: the shared options (`AttentionOptions`; None: the defaults).
    new_tokens: a cached call's new tokens (its queries at `query_offset` into keys the
      cache holds): one token resolves "auto" to "xla" (`resolve`).
    probabilities: return the attention probabilities, float32 `[B, H, T, T]`, instead
      of the outputs (kinds with `probability_implementations`; keys of the queries' own
      sequence).
    **overrides: any `AttentionOptions` field as a keyword, applied over `options`.

  Returns:
    what the chosen implementation returns (per-head outputs `[B, N, H, dv]`, or the
    probabilities).

  Raises:
    ValueError: naming the argument, for arrays the record refuses
      (`check_arrays`), options that do not fit the queries, or an implementation the
      kind lacks.
  """
  record = _record(kind)
  if any(isinstance(x, AttentionOptions) for x in arrays):
    raise TypeError(f"attend({record.name!r}, ...): pass the AttentionOptions as options=")
  options = with_overrides(options, overrides)
  if options.sliced and (probabilities or not record.decodes):
    raise ValueError(
      f"query_offset, kv_segment_ids and kv_positions place queries into longer keys (a "
      f"cached call); {record.name} attention {'probabilities take' if probabilities else 'takes'}"
      " the keys of its queries' own sequence"
    )
  if options.sliced:  # (only kinds that decode take keys longer than their queries)
    record.check_arrays(*arrays, sliced=True)
  else:
    record.check_arrays(*arrays)
  if not record.uses_rope:
    options = options.replace(rope_theta=None)  # documented as ignored
  options = validation.check_options(arrays[0], options)
  if options.sliced:
    validation.check_key_side(arrays[1], options)
  q, v, num_pseudo = record.auto_inputs(*arrays)
  if options.dropout_rate:
    _check_dropout(record, options, q, v, num_pseudo)
  facts = dict(new_tokens=new_tokens, probabilities=probabilities)
  fn = lookup(record, options.implementation, q, v, options, num_pseudo, **facts)
  return fn(*arrays, options)


def _check_dropout(record: AttentionKind, options: AttentionOptions, q, v, num_pseudo) -> None:
  """Raises ValueError unless the implementation this call runs applies attention dropout
  (the record's `dropout_implementations`)."""
  sliced = context.applies(q.shape[1])
  name = resolve(record, options.implementation, q, v, options, num_pseudo, sliced=sliced)
  if name not in record.dropout_implementations:
    chose = f" ('auto' chose {name!r} here)" if options.implementation == AUTO else ""
    fix = sorted(record.dropout_implementations)
    raise ValueError(
      f"dropout_rate={options.dropout_rate}: {record.name} attention's {name!r} implementation"
      f"{chose} has no attention dropout; "
      + (f"use implementation={fix[0]!r}" if fix else "use dropout_rate=0")
      + " (or no dropout: deterministic=True)."
    )
