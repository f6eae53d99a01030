"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology").

A context of `num_pairs` key-value pairs is followed by a query region in which
`num_queries` of the keys reappear at random positions; the model must emit each queried
key's value at that key's position.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from iha_jax.data import builder_base

PAD = 0
BOS = 1
BLANK = 2
KEY_OFFSET = 3


@dataclasses.dataclass(eq=False, kw_only=True)
class MqarConfig(builder_base.SyntheticConfig):
  """MQAR task parameters.

  Attributes:
    length: example length `L` in tokens (every example has exactly `L`).
    num_pairs: key-value pairs in the context; keys are distinct.
    num_queries: keys queried (distinct, at most `num_pairs`); `None` queries every key
      once.
    num_keys: size of the key vocabulary.
    num_values: size of the value vocabulary.
  """

  length: int = 64
  num_pairs: int = 4
  num_queries: int | None = None
  num_keys: int = 4096
  num_values: int = 4096

  @property
  def queries(self) -> int:
    return self.num_pairs if self.num_queries is None else self.num_queries

  @property
  def value_offset(self) -> int:
    return KEY_OFFSET + self.num_keys

  @property
  def vocab_size(self) -> int:
    return self.value_offset + self.num_values

  def validate(self) -> None:
    super().validate()
    if not 1 <= self.num_pairs <= self.num_keys:
      raise ValueError(f"Need 1 <= num_pairs <= num_keys, got {self.num_pairs}, {self.num_keys}.")
    if not 1 <= self.queries <= self.num_pairs:
      raise ValueError(f"Need 1 <= num_queries <= num_pairs, got {self.queries}, {self.num_pairs}.")
    if self.num_values < 1:
      raise ValueError(f"num_values must be >= 1, got {self.num_values}.")
    query_region = self.length - 1 - 2 * self.num_pairs
    if query_region < self.queries:
      raise ValueError(
        f"length={self.length} leaves {query_region} query positions after"
        f" BOS and {self.num_pairs} pairs; need >= {self.queries}."
      )


def generate_example(rng: np.random.Generator, config: MqarConfig) -> builder_base.Example:
  """Draws one MQAR example.

  Args:
    rng: the example's generator.
    config: task parameters.

  Returns:
    `inputs`, `targets` (int32 [L]) and `weights` (float32 [L]).
  """
  keys = KEY_OFFSET + rng.choice(config.num_keys, config.num_pairs, replace=False)
  values = config.value_offset + rng.integers(0, config.num_values, config.num_pairs)
  context = np.stack([keys, values], axis=1).reshape(-1)
  query_start = 1 + context.size
  region = config.length - query_start
  queried = rng.choice(config.num_pairs, config.queries, replace=False)
  slots = query_start + np.sort(rng.choice(region, config.queries, replace=False))

  inputs = np.full(config.length, BLANK, np.int32)
  inputs[0] = BOS
  inputs[1:query_start] = context
  inputs[slots] = keys[queried]
  targets = np.full(config.length, PAD, np.int32)
  targets[slots] = values[queried]
  weights = np.zeros(config.length, np.float32)
  weights[slots] = 1.0
  return {"inputs": inputs, "targets": targets, "weights": weights}


def _config(name: str, length: int, num_pairs: int, **kwargs) -> MqarConfig:
  return MqarConfig(
    name=name,
    description=f"{num_pairs} pairs, length {length}.",
    length=length,
    num_pairs=num_pairs,
    **kwargs,
  )


class Mqar(builder_base.SyntheticBuilder):
  """Multi-query associative recall, rendered for a decoder-only LM.

  Vocabulary: `0` PAD, `1` BOS, `2` BLANK, keys
  `3 .. 3 + num_keys - 1`, values `3 + num_keys .. vocab_size - 1`
  (`vocab_size = 3 + num_keys + num_values`, 8195 by default as in Zoology's
  8192-token vocabulary).

  Layout (length `L`)::

    inputs   BOS k1 v1 k2 v2 .. kN vN  BLANK .. k7 .. BLANK .. k2 .. BLANK
    targets  PAD PAD ...            PAD  PAD   .. v7 .. PAD   .. v2 .. PAD
    weights  0   0   ...            0    0     .. 1  .. 0     .. 1  .. 0

  A queried key sits at a uniformly random position of the query region and
  its value is the target at that same position, so a causal LM predicts it
  from the key it has just read. Values occur in `inputs` only inside the
  key-value context, never in the query region.
  """

  BUILDER_CONFIGS = [
    _config("kv4_len64", 64, 4),
    _config("kv8_len128", 128, 8),
    _config("kv16_len256", 256, 16),
    _config("kv32_len256", 256, 32),
    _config("kv64_len256", 256, 64),
    _config("kv128_len512", 512, 128),
    _config(
      "cpu_demo",
      64,
      8,
      num_keys=64,
      num_values=64,
      num_train=4096,
      num_validation=256,
      num_test=256,
    ),
  ]

  def generate_example(self, rng: np.random.Generator) -> builder_base.Example:
    return generate_example(rng, self.config)
