"""Polynomial filters on a graph, the IHA paper's other theory task (sections 3-4, App. B).

A fixed graph on `n` nodes (an Erdos-Renyi graph with self-loops, drawn once from the
config's seed) gives the normalised adjacency `A`; every example draws Gaussian node
features `X: [n, F]`, and the target of node `i` is its row of the filtered signals

  [X, A X, A^2 X, ..., A^(k-1) X]      ([n, k F], power-major)

each power divided by its root-mean-square over nodes and draws, so every output column
has unit variance. A node is a token (its id, plus `X_i` as continuous features); the
targets are per-node regression values for a bidirectional encoder. Each power is one
attention pattern over the nodes, so an MHA layer needs about `k - 1` heads (`A^0` is the
residual); the paper constructs IHA with about `sqrt(k)` (it trains neither).

`A` is the random-walk normalisation `D^-1 (A_graph + I)` (rows sum to 1), a decision of
this project: its powers are row-stochastic like softmax attention, so every power is
reachable by one head and the head count, not the normalisation, is what limits a model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from iha_jax.data import builder_base


@dataclasses.dataclass(eq=False, kw_only=True)
class PolynomialFilterConfig(builder_base.SyntheticConfig):
  """Polynomial-filter task parameters.

  Attributes:
    num_nodes: `n`, the graph's nodes (= tokens per example; ids `1 .. n`).
    edge_probability: probability of each undirected edge of the random graph.
    num_features: `F`, Gaussian features per node.
    num_powers: `k`: targets are `A^0 X .. A^(k-1) X`.
  """

  num_nodes: int = 16
  edge_probability: float = 0.2
  num_features: int = 2
  num_powers: int = 4

  @property
  def vocab_size(self) -> int:
    return 1 + self.num_nodes  # 0 is padding

  @property
  def num_values(self) -> int:
    """Regression values per node, `k F`."""
    return self.num_powers * self.num_features

  def validate(self) -> None:
    super().validate()
    for name in ("num_nodes", "num_features", "num_powers"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if not 0.0 <= self.edge_probability <= 1.0:
      raise ValueError(f"edge_probability must be in [0, 1], got {self.edge_probability}.")


def adjacency(config: PolynomialFilterConfig) -> np.ndarray:
  """The task's fixed normalised adjacency `D^-1 (A_graph + I)`, float64 `[n, n]`."""
  n = config.num_nodes
  rng = np.random.default_rng([config.seed, 7919])  # the graph's own stream
  upper = np.triu(rng.random((n, n)) < config.edge_probability, k=1)
  graph = (upper | upper.T | np.eye(n, dtype=bool)).astype(np.float64)
  return graph / graph.sum(axis=1, keepdims=True)


def power_scales(a: np.ndarray, num_powers: int) -> np.ndarray:
  """RMS of `(A^j X)` over nodes for unit Gaussian `X`: `||A^j||_F / sqrt(n)`, `[k]`."""
  n = a.shape[0]
  scales, power = [], np.eye(n)
  for _ in range(num_powers):
    scales.append(np.linalg.norm(power) / np.sqrt(n))
    power = a @ power
  return np.asarray(scales)


def filter_targets(a: np.ndarray, x: np.ndarray, num_powers: int) -> np.ndarray:
  """`[A^0 X, ..., A^(k-1) X]` of `x: [n, F]`, each power over its `power_scales`, float32
  `[n, k F]` (power-major)."""
  out, signal = [], x.astype(np.float64)
  for scale in power_scales(a, num_powers):
    out.append(signal / scale)
    signal = a @ signal
  return np.concatenate(out, axis=1).astype(np.float32)


class PolynomialFilter(builder_base.SyntheticBuilder):
  """Polynomial filters `[X, AX, .., A^(k-1) X]` on a fixed random graph, per node.

  `inputs` are the node ids `1 .. n` (vocab_size `n + 1`), `features` the node's
  Gaussian `X_i` (`[n, F]`), `values` its normalised targets (`[n, k F]`); `targets` is
  unused (zeros), every node is weighted. Configs `k4`, `k9`, `k16`: 16 nodes, edge
  probability 0.2, F = 2, k powers.
  """

  BUILDER_CONFIGS = [
    PolynomialFilterConfig(name=f"k{k}", description=f"{k} powers, 16 nodes.", num_powers=k)
    for k in (4, 9, 16)
  ]

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self._adjacency = adjacency(self.config)

  def extra_features(self) -> dict[str, tfds.features.FeatureConnector]:
    return {
      "features": tfds.features.Tensor(shape=(None, self.config.num_features), dtype=np.float32),
      "values": tfds.features.Tensor(shape=(None, self.config.num_values), dtype=np.float32),
    }

  def generate_example(self, rng: np.random.Generator) -> builder_base.Example:
    n = self.config.num_nodes
    x = rng.standard_normal((n, self.config.num_features))
    return {
      "inputs": np.arange(1, n + 1, dtype=np.int32),
      "targets": np.zeros(n, np.int32),
      "weights": np.ones(n, np.float32),
      "features": x.astype(np.float32),
      "values": filter_targets(self._adjacency, x, self.config.num_powers),
    }
