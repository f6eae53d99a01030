"""CPM-3: counting pairs modulo `M`, the IHA paper's theory task (sections 3-4, App. B).

A sequence `x_1 .. x_n` of integers in `1..M` is given; the label of position `i` is

  count_i = #{(j1, j2) in [n]^2 : x_i + G * x_j1 + x_j2 = 0 (mod M)},

over all ordered pairs of the whole sequence (`j1 = j2` included, either may be `i`). The
paper's example, `M = 3`, `G = 10`, `x = (1, 2, 3)`, gives `(3, 3, 3)`. Each label depends
on the whole sequence, so the task is rendered for a bidirectional encoder with a
per-position classification head of `max_length^2 + 1` classes (the counts `0 .. n^2`).
The paper trains no model on it; the project uses it as an empirical probe of how accuracy
grows with the number of heads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from iha_jax.data import builder_base

PAD = 0  # values are their own token ids, 1 .. M


@dataclasses.dataclass(eq=False, kw_only=True)
class Cpm3Config(builder_base.SyntheticConfig):
  """CPM-3 task parameters.

  Attributes:
    min_length: shortest sequence `n`.
    max_length: longest sequence; it sizes the label classes (`max_length^2 + 1`).
    modulus: `M`; values are drawn uniformly from `1..M`.
    multiplier: `G`, the weight of `x_j1`.
  """

  min_length: int = 8
  max_length: int = 8
  modulus: int = 3
  multiplier: int = 10

  @property
  def vocab_size(self) -> int:
    return 1 + self.modulus

  @property
  def num_classes(self) -> int:
    """Label classes: the counts `0 .. max_length^2`."""
    return self.max_length**2 + 1

  def validate(self) -> None:
    super().validate()
    if not 1 <= self.min_length <= self.max_length:
      raise ValueError(
        f"Need 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}."
      )
    if self.modulus < 2:
      raise ValueError(f"modulus must be >= 2, got {self.modulus}.")


def pair_counts(values: np.ndarray, modulus: int, multiplier: int) -> np.ndarray:
  """CPM-3 labels of one sequence.

  Args:
    values: int [n], the sequence.
    modulus: `M`.
    multiplier: `G`.

  Returns:
    int32 [n]: for each `i`, the ordered pairs `(j1, j2)` of the sequence with
    `x_i + G x_j1 + x_j2 = 0 (mod M)`. Computed from the residue histogram `c`:
    `count_i = sum_r c[r] * c[(-x_i - G r) mod M]`.
  """
  residues = np.mod(values, modulus)
  histogram = np.bincount(residues, minlength=modulus)
  r = np.arange(modulus)
  partner = np.mod(-residues[:, None] - multiplier * r[None, :], modulus)  # [n, M]
  return (histogram[None, :] * histogram[partner]).sum(axis=1).astype(np.int32)


def generate_example(rng: np.random.Generator, config: Cpm3Config) -> builder_base.Example:
  """Draws one sequence: `inputs` (the values), `targets` (the counts), `weights` (1)."""
  n = int(rng.integers(config.min_length, config.max_length + 1))
  values = rng.integers(1, config.modulus + 1, n).astype(np.int32)
  return {
    "inputs": values,
    "targets": pair_counts(values, config.modulus, config.multiplier),
    "weights": np.ones(n, np.float32),
  }


class Cpm3(builder_base.SyntheticBuilder):
  """CPM-3 (count pairs modulo M), rendered for a bidirectional encoder.

  Vocabulary: `0` PAD, values `1 .. M` as themselves (`vocab_size = M + 1`).
  `inputs` is the sequence, `targets` the count of every position (a class in
  `0 .. max_length^2`), every position weighted; a batch is right-padded
  (segment 0). Configs `len8`, `len16`, `len32`: that fixed length, `M = 3`,
  `G = 10`. Fixed, because a count scales with `n` and softmax attention (a weighted
  average) does not see `n`: with varying lengths, `x = (1)` and `x = (1, 1)` give
  the same attention output but counts 1 and 4. `min_length` < `max_length` makes the
  task need a length signal (e.g. a sink token) as well.
  """

  BUILDER_CONFIGS = [
    Cpm3Config(
      name=f"len{n}", description=f"length {n}, M = 3, G = 10.", min_length=n, max_length=n
    )
    for n in (8, 16, 32)
  ]

  def generate_example(self, rng: np.random.Generator) -> builder_base.Example:
    return generate_example(rng, self.config)
