"""The KV caches of a `TransformerLM`: one `LayerCache` per block (docs/design.md §1.2-1.7).

Each attention layer runs its own cached call (`iha_jax.nn.cache`: ring buffers over
token slots, window layers keeping only what their window sees, IHA's "source" and
"pseudo" layouts, G key/value heads), the same per-layer API a model of your own uses
(docs/your_model.md). This module only gathers the layers' caches and checks that a
model can decode: a causal LM whose layers' kinds decode.
"""

from __future__ import annotations

import jax
from flax import struct

from iha_jax import kinds
from iha_jax.checks import warn_deprecated
from iha_jax.models.config import TransformerConfig
from iha_jax.nn.cache import (
  CACHE_MODES,
  LayerCache,
  check_cache_mode,
  init_layer_cache,
  ring_slots,
  slot_tokens,
)

__all__ = [
  "CACHE_MODES",
  "KVCache",
  "LayerCache",
  "check_cache_mode",
  "check_decodable",
  "decodable_letters",
  "init_cache",
  "init_layer_cache",
  "ring_slots",
  "slot_tokens",
]


class KVCache(struct.PyTreeNode):
  """The caches of every layer of a `TransformerLM`.

  Attributes:
    layers: one `LayerCache` per decoder block (each with its `length`).
    mode: "source" or "pseudo" (layout of the IHA layers), static.
    max_len: tokens the cache can hold in all (capacity of the global layers), static.
  """

  layers: tuple[LayerCache, ...]
  mode: str = struct.field(pytree_node=False)
  max_len: int = struct.field(pytree_node=False)

  @property
  def length(self) -> jax.Array:
    """`[B]` int32: the tokens each row holds = the position of its next token."""
    return self.layers[0].length

  @property
  def nbytes(self) -> int:
    """Bytes of all cached keys and values."""
    return sum(layer.nbytes for layer in self.layers)


def decodable_letters() -> str:
  """Schedule letters whose kinds decode with a KV cache (I, L, M, S built in)."""
  return "".join(
    letter for letter in kinds.LETTER_DESCRIPTIONS if kinds.for_letter(letter)[0].decodes
  )


def check_decodable(config: TransformerConfig) -> None:
  """Raises ValueError unless a KV cache can decode a model with `config`: a causal LM
  (no encoder, no per-token output head) whose layers' kinds decode."""
  if not config.causal:
    raise ValueError(
      "KV-cache decoding needs a causal model; this one has causal=False "
      "(a bidirectional encoder: every position sees later tokens). Run the "
      "full forward instead."
    )
  if config.num_outputs is not None:
    raise ValueError(
      f"KV-cache decoding needs next-token logits; this model has a per-token "
      f"head (num_outputs={config.num_outputs})."
    )
  other = sorted(set(config.schedule) - set(decodable_letters()))
  if other:
    names = sorted({kinds.for_letter(letter)[0].name for letter in other})
    raise ValueError(
      f"KV-cache decoding supports schedule letters {decodable_letters()!r}; "
      f"attention_schedule {config.attention_schedule!r} has {other} ({', '.join(names)} "
      f"attention, which does not decode). Run the full forward for those models."
    )


def init_cache(config: TransformerConfig, batch: int, max_len: int, mode: str) -> KVCache:
  """Empty caches for every layer of a model with `config` (computation dtype)."""
  check_decodable(config)
  check_cache_mode(mode)
  letters = {letter: config.attention_config(letter) for letter in set(config.schedule)}
  layers = tuple(
    init_layer_cache(letters[letter], batch, max_len, mode, config.dtype)
    for letter in config.schedule
  )
  return KVCache(layers=layers, mode=mode, max_len=max_len)


def __getattr__(name: str) -> object:
  if name == "window_tokens":  # renamed: `window_tokens` is a window in tokens (the layers')
    warn_deprecated("iha_jax.models.kv_cache.window_tokens", "ring_slots (the ring's token slots)")
    return ring_slots
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
