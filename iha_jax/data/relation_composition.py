"""Binary and ternary relation composition (IHA paper, App. D).

A random `m x m` boolean relation `R` is drawn with i.i.d. Bernoulli(`density`) entries
and `m` uniform in `min_size..max_size`. The label of cell `(i, j)` is `(R o R)[i, j]`
(binary: some `k` has `R[i, k]` and `R[k, j]`) or `(R o R o R)[i, j]` (ternary).

Two renderings: for a decoder-only LM (a query block after the matrix, labels
as tokens) and, `encoder=True`, the paper's encoder format (the `m^2` cells row-major, one
0/1 label per cell for a bidirectional model with a per-position binary head).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from iha_jax.data import builder_base

PAD = 0
BOS = 1
SEP = 2
FALSE = 3
TRUE = 4
CELL_OFFSET = 5


@dataclasses.dataclass(eq=False, kw_only=True)
class RelationCompositionConfig(builder_base.SyntheticConfig):
  """Relation composition task parameters.

  Attributes:
    hops: number of factors in the composition (2 binary, 3 ternary).
    min_size: smallest matrix side `m`.
    max_size: largest matrix side `M`; it sizes the vocabulary.
    density: probability that an entry of `R` is true.
    encoder: the encoder rendering (`m^2` cell tokens, 0/1 targets per cell) instead of
      the decoder-only one.
  """

  hops: int = 2
  min_size: int = 6
  max_size: int = 10
  density: float = 0.325
  encoder: bool = False

  @property
  def query_offset(self) -> int:
    return CELL_OFFSET + 2 * self.max_size**2

  @property
  def vocab_size(self) -> int:
    return self.query_offset + self.max_size**2

  @property
  def max_length(self) -> int:
    """Length of an example with `m = max_size`."""
    return self.max_size**2 if self.encoder else 2 * self.max_size**2 + 2

  def validate(self) -> None:
    super().validate()
    if self.hops < 1:
      raise ValueError(f"hops must be >= 1, got {self.hops}.")
    if not 1 <= self.min_size <= self.max_size:
      raise ValueError(f"Need 1 <= min_size <= max_size, got {self.min_size}, {self.max_size}.")
    if not 0.0 <= self.density <= 1.0:
      raise ValueError(f"density must be in [0, 1], got {self.density}.")


def compose(relation: np.ndarray, hops: int) -> np.ndarray:
  """Boolean composition of a square relation with itself.

  Args:
    relation: bool [m, m].
    hops: number of factors; 1 returns `relation`.

  Returns:
    bool [m, m], `R o R o ... o R` with `hops` factors.
  """
  as_int = relation.astype(np.int64)
  result = as_int
  for _ in range(hops - 1):
    result = np.minimum(result @ as_int, 1)
  return result.astype(bool)


def generate_example(
  rng: np.random.Generator, config: RelationCompositionConfig
) -> builder_base.Example:
  """Draws one relation and renders it for a decoder-only LM or an encoder.

  Args:
    rng: the example's generator.
    config: task parameters.

  Returns:
    `inputs`, `targets` (int32), `weights` (float32) and `labels` (int32 [m^2], the raw
    0/1 label of each cell in row-major order). Decoder: length `2 m^2 + 2`, label tokens
    at the query block. Encoder: length `m^2`, `inputs` the cell tokens, `targets` the 0/1
    labels, all weighted.
  """
  m = int(rng.integers(config.min_size, config.max_size + 1))
  relation = rng.random((m, m)) < config.density
  labels = compose(relation, config.hops).reshape(-1).astype(np.int32)
  rows, cols = np.divmod(np.arange(m * m), m)
  cell_ids = rows * config.max_size + cols
  cells = CELL_OFFSET + 2 * cell_ids + relation.reshape(-1)
  if config.encoder:
    return {
      "inputs": cells.astype(np.int32),
      "targets": labels,
      "weights": np.ones(m * m, np.float32),
      "labels": labels,
    }
  queries = config.query_offset + cell_ids
  inputs = np.concatenate([[BOS], cells, [SEP], queries]).astype(np.int32)
  answer_start = m * m + 2
  targets = np.full_like(inputs, PAD)
  targets[answer_start:] = FALSE + labels
  weights = np.zeros(inputs.shape, np.float32)
  weights[answer_start:] = 1.0
  return {"inputs": inputs, "targets": targets, "weights": weights, "labels": labels}


class RelationComposition(builder_base.SyntheticBuilder):
  """Relation composition, rendered for a decoder-only LM.

  Vocabulary (`M = max_size`):

  * `0` PAD, `1` BOS, `2` SEP, `3` FALSE, `4` TRUE (label tokens);
  * `5 + 2 * (i * M + j) + R[i, j]`: cell `(i, j)` holding value
    `R[i, j]`;
  * `5 + 2 * M * M + i * M + j`: the query for cell `(i, j)`.

  `vocab_size = 5 + 3 * M * M` (305 binary, 197 ternary).

  Layout (length `2 m^2 + 2`)::

    inputs   BOS  cell(0,0) .. cell(m-1,m-1)  SEP  query(0,0) .. query(m-1,m-1)
    targets  PAD  PAD       .. PAD            PAD  label(0,0) .. label(m-1,m-1)
    weights  0    0         .. 0              0    1          .. 1

  The matrix is the row-major block of `m^2` cell tokens. Labels are
  scored at the query positions, where a causal model has seen the whole
  matrix (at the cell positions it has not). Each token names its cell, so a
  position never needs to infer `(i, j)` from an offset that depends on
  `m`, like the 2-D positional encodings of the original encoder setup. The
  label tokens FALSE/TRUE never occur in `inputs`. The extra feature
  `labels` holds the raw 0/1 labels (int32 [m^2]) for binary cross-entropy
  heads.

  Encoder rendering (configs `binary_encoder`, `ternary_encoder`; the
  paper's format for its one-layer bidirectional models): `inputs` are the
  `m^2` cell tokens alone (each names its value and its `(i, j)`: the
  value plus a 2-D position, since `m` varies), `targets` the 0/1 label of
  every cell, every position weighted; a batch is right-padded (segment 0).
  """

  BUILDER_CONFIGS = [
    RelationCompositionConfig(
      name="binary",
      description="R o R, m in 6..10, Bernoulli(0.325).",
      hops=2,
      min_size=6,
      max_size=10,
      density=0.325,
    ),
    RelationCompositionConfig(
      name="ternary",
      description="R o R o R, m in 5..8, Bernoulli(0.264).",
      hops=3,
      min_size=5,
      max_size=8,
      density=0.264,
    ),
  ]
  # The same tasks in the encoder rendering: "binary_encoder", "ternary_encoder".
  BUILDER_CONFIGS += [
    dataclasses.replace(
      config,
      name=f"{config.name}_encoder",
      description=config.description.removesuffix(".") + "; encoder rendering.",
      encoder=True,
    )
    for config in BUILDER_CONFIGS
  ]

  def generate_example(self, rng: np.random.Generator) -> builder_base.Example:
    return generate_example(rng, self.config)

  def extra_features(self) -> dict[str, tfds.features.FeatureConnector]:
    return {"labels": tfds.features.Tensor(shape=(None,), dtype=np.int32)}
