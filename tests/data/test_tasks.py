"""Synthetic-task builders: offline preparation and examples recomputed."""

import itertools
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

import iha_jax.data as data
from iha_jax.data import build, cpm3, mqar
from iha_jax.data import multikey_retrieval as mkr
from iha_jax.data import polynomial_filter as pf
from iha_jax.data import relation_composition as rc

tfds.disable_progress_bar()

TINY = {"num_train": 64, "num_validation": 4, "num_test": 4}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _examples(name, data_dir, options, split="train"):
  """Prepares `name` and reads a split through `tfds.data_source`."""
  builder = data.prepare(name, data_dir, options=options)
  full_name = f"{builder.name}/{builder.builder_config.name}"
  source = tfds.data_source(full_name, split=split, data_dir=data_dir)
  return builder.builder_config, [source[i] for i in range(len(source))]


def _compose_by_loops(relation, hops):
  m = len(relation)
  label = np.zeros((m, m), bool)
  for i, j in itertools.product(range(m), repeat=2):
    for path in itertools.product(range(m), repeat=hops - 1):
      nodes = (i, *path, j)
      if all(relation[a, b] for a, b in zip(nodes, nodes[1:])):
        label[i, j] = True
        break
  return label


@pytest.mark.parametrize("config_name", ["binary", "ternary"])
def test_relation_composition_labels_match_the_matrix_in_the_inputs(config_name, data_dir):
  config, examples = _examples(f"relation_composition/{config_name}", data_dir, TINY)
  big_m = config.max_size
  sizes, entries = [], []
  for ex in examples:
    inputs, targets, weights = ex["inputs"], ex["targets"], ex["weights"]
    sep = int(np.flatnonzero(inputs == rc.SEP)[0])
    m = int(round(np.sqrt(sep - 1)))
    assert inputs[0] == rc.BOS and sep == m * m + 1
    assert len(inputs) == len(targets) == len(weights) == 2 * m * m + 2
    cells = inputs[1:sep] - rc.CELL_OFFSET
    cell_ids, values = np.divmod(cells, 2)
    rows, cols = np.divmod(cell_ids, big_m)
    np.testing.assert_array_equal(rows, np.repeat(np.arange(m), m))
    np.testing.assert_array_equal(cols, np.tile(np.arange(m), m))
    relation = values.reshape(m, m).astype(bool)

    expected = _compose_by_loops(relation, config.hops).reshape(-1)
    queries = inputs[sep + 1 :] - config.query_offset
    np.testing.assert_array_equal(queries, cell_ids)
    np.testing.assert_array_equal(targets[sep + 1 :], rc.FALSE + expected)
    np.testing.assert_array_equal(ex["labels"], expected)
    np.testing.assert_array_equal(weights, np.arange(len(inputs)) > sep)
    assert not np.any(targets[: sep + 1]) and inputs.max() < config.vocab_size
    assert not np.isin(inputs, [rc.FALSE, rc.TRUE]).any()
    sizes.append(m)
    entries.append(values)
  assert set(sizes) == set(range(config.min_size, config.max_size + 1))
  assert abs(np.concatenate(entries).mean() - config.density) < 0.04


def test_mqar_targets_are_the_values_of_the_queried_keys(data_dir):
  options = dict(TINY, num_queries=5)
  config, examples = _examples("mqar/kv8_len128", data_dir, options)
  for ex in examples:
    inputs, targets, weights = ex["inputs"], ex["targets"], ex["weights"]
    assert len(inputs) == len(targets) == len(weights) == config.length
    assert inputs[0] == mqar.BOS
    context = inputs[1 : 1 + 2 * config.num_pairs]
    keys, values = context[0::2], context[1::2]
    assert len(set(keys.tolist())) == config.num_pairs
    assert np.all((keys >= mqar.KEY_OFFSET) & (keys < config.value_offset))
    assert np.all((values >= config.value_offset) & (values < config.vocab_size))
    value_of = dict(zip(keys.tolist(), values.tolist()))

    region = np.arange(1 + 2 * config.num_pairs, config.length)
    slots = region[inputs[region] != mqar.BLANK]
    assert len(slots) == config.queries
    assert len(set(inputs[slots].tolist())) == config.queries
    np.testing.assert_array_equal(targets[slots], [value_of[k] for k in inputs[slots].tolist()])
    np.testing.assert_array_equal(np.flatnonzero(weights), slots)
    assert not np.any(np.delete(targets, slots))
    assert not np.isin(inputs[region], values).any()


def test_multikey_retrieval_answers_come_from_the_needles(data_dir):
  options = dict(TINY, num_needles=6, num_queries=2)
  config, examples = _examples("multikey_retrieval/cpu_demo", data_dir, options)
  k, v = config.key_len, config.value_len
  first_query = 1 + config.haystack_len
  for ex in examples:
    inputs, targets, weights = ex["inputs"], ex["targets"], ex["weights"]
    assert len(inputs) == len(targets) == len(weights) == config.length
    assert inputs[0] == mkr.BOS

    haystack = inputs[1:first_query]
    starts = np.flatnonzero(haystack == mkr.NEEDLE)
    assert len(starts) == config.num_needles
    value_of = {}
    for s in starts:
      key = tuple(haystack[s + 1 : s + 1 + k].tolist())
      value = haystack[s + 1 + k : s + 1 + k + v]
      assert all(config.key_offset <= t < config.value_offset for t in key)
      assert np.all(value >= config.value_offset)
      assert key not in value_of
      value_of[key] = value
    needle_mask = np.zeros(len(haystack), bool)
    for s in starts:
      needle_mask[s : s + config.needle_len] = True
    filler = haystack[~needle_mask]
    assert np.all((filler >= config.filler_offset) & (filler < config.key_offset))

    scored = []
    for q in range(config.num_queries):
      block = inputs[first_query + q * config.query_len :][: config.query_len]
      assert block[0] == mkr.QUERY
      # The first value token is due at the key's last token, the others at placeholders.
      slots = first_query + q * config.query_len + k + np.arange(v)
      np.testing.assert_array_equal(inputs[slots[1:]], mkr.ANSWER_OFFSET + np.arange(v - 1))
      np.testing.assert_array_equal(targets[slots], value_of[tuple(block[1 : 1 + k])])
      scored.append(slots)
    scored = np.concatenate(scored)
    np.testing.assert_array_equal(np.flatnonzero(weights), scored)
    assert not np.any(np.delete(targets, scored))
    assert not np.any(inputs[first_query:] >= config.value_offset)


def test_cpm3_counts_the_paper_example():
  # The paper's example: M = 3, G = 10, x = (1, 2, 3) -> (3, 3, 3).
  np.testing.assert_array_equal(cpm3.pair_counts(np.array([1, 2, 3]), 3, 10), [3, 3, 3])


def test_cpm3_labels_count_the_pairs_of_the_inputs(data_dir):
  options = dict(TINY, modulus=5, multiplier=7, min_length=3)
  config, examples = _examples("cpm3/len8", data_dir, options)
  lengths = []
  for ex in examples:
    x = ex["inputs"]
    n = len(x)
    expected = [
      sum((xi + 7 * a + b) % 5 == 0 for a, b in itertools.product(x, repeat=2)) for xi in x
    ]
    np.testing.assert_array_equal(ex["targets"], expected)
    np.testing.assert_array_equal(ex["weights"], np.ones(n))
    assert 1 <= x.min() and x.max() <= 5 < config.vocab_size
    assert ex["targets"].max() < config.num_classes
    lengths.append(n)
  assert set(lengths) == set(range(config.min_length, config.max_length + 1))
  with pytest.raises(ValueError, match="modulus must be >= 2"):
    data.builder_config("cpm3/len8", {"modulus": 1})


def test_polynomial_filter_values_are_the_powers_of_the_graph_on_the_features(data_dir):
  options = dict(
    TINY, num_train=1024, num_nodes=6, num_features=3, num_powers=4, edge_probability=0.5
  )
  config, examples = _examples("polynomial_filter/k4", data_dir, options)
  a = pf.adjacency(config)
  # A random graph with self-loops, random-walk normalised: symmetric support, rows sum to 1.
  assert np.all(np.diag(a) > 0)
  np.testing.assert_array_equal(a > 0, (a > 0).T)
  np.testing.assert_allclose(a.sum(axis=1), 1.0)
  assert 0 < np.count_nonzero(a - np.diag(np.diag(a)))  # some edges
  values = []
  for ex in examples:
    x = ex["features"]
    assert x.shape == (6, 3) and ex["values"].shape == (6, 12)
    np.testing.assert_array_equal(ex["inputs"], np.arange(1, 7))
    for j in range(4):  # block j is A^j X over its RMS scale
      power = np.linalg.matrix_power(a, j)
      scale = np.sqrt(np.sum(power**2) / 6)
      np.testing.assert_allclose(ex["values"][:, 3 * j : 3 * j + 3] * scale, power @ x, atol=1e-5)
    values.append(ex["values"])
  # The scales give every power's values unit mean square (1024 draws, 6 nodes, 3 features).
  mean_squares = np.square(np.concatenate(values)).reshape(-1, 4, 3).mean(axis=(0, 2))
  np.testing.assert_allclose(mean_squares, 1.0, atol=0.15)
  with pytest.raises(ValueError, match="edge_probability"):
    data.builder_config("polynomial_filter/k4", {"edge_probability": 1.5})


def test_continuous_fields_are_batched_and_padded_never_packed(data_dir):
  name, options = "polynomial_filter/k4", dict(TINY, num_nodes=5, num_validation=3)
  config = {"name": name, "seq_len": 8, "data_dir": data_dir, "options": options}
  data.prepare(name, data_dir, options=options)
  batches = list(
    data.make_dataset(
      config,
      "validation",
      global_batch_size=4,
      shuffle=False,
      num_epochs=1,
      shard_count=2,
      shard_index=1,
    )
  )
  # Shard 1 of 2 holds one of the 3 examples plus one padding example (equal shard
  # sizes): its continuous fields are padded like the rest.
  assert len(batches) == 1
  batch = batches[0]
  assert batch["features"].shape == (2, 8, 2) and batch["values"].shape == (2, 8, 8)
  np.testing.assert_array_equal(batch["weights"][0], [1] * 5 + [0] * 3)
  assert not batch["weights"][1].any() and not batch["features"][0, 5:].any()
  assert batch["features"][0, :5].any()
  with pytest.raises(data.DataError, match="packing=False"):
    data.make_dataset(dict(config, packing=True), "train", global_batch_size=2)


def test_generation_is_a_function_of_the_config_seed(tmp_path):
  name = "mqar/kv4_len64"
  _, first = _examples(name, str(tmp_path / "a"), TINY)
  _, again = _examples(name, str(tmp_path / "b"), TINY)
  _, other = _examples(name, str(tmp_path / "c"), dict(TINY, seed=1))
  as_set = lambda examples: {ex["inputs"].tobytes() for ex in examples}
  assert as_set(first) == as_set(again)
  assert len(as_set(first)) == TINY["num_train"]
  assert not as_set(first) & as_set(other)


def test_tfds_api_prepares_array_record_without_tensorflow(tmp_path):
  config = data.builder_config("relation_composition/ternary", TINY)
  builder = tfds.builder("relation_composition", config=config, data_dir=str(tmp_path))
  builder.download_and_prepare()
  assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
  assert builder.info.metadata["vocab_size"] == config.vocab_size == 197
  assert list(tmp_path.rglob("*.array_record*"))
  source = tfds.data_source(
    f"relation_composition/{config.name}", split="test", data_dir=str(tmp_path)
  )
  assert len(source) == TINY["num_test"]
  assert set(source[0]) == {"inputs", "targets", "weights", "labels"}
  assert "tensorflow" not in sys.modules


def test_build_cli_lists_the_datasets(capsys):
  build.main(["--list"])
  assert capsys.readouterr().out.split() == data.list_datasets()
  assert "relation_composition/ternary" in data.list_datasets()


def test_options_rename_the_config_and_are_validated():
  base = data.builder_config("mqar/kv8_len128")
  assert base.name == "kv8_len128" and base.vocab_size == 8195
  assert data.builder_config("mqar/kv8_len128", {"length": 128}) is base
  changed = data.builder_config("mqar/kv8_len128", {"seed": 3})
  assert changed.name.startswith("kv8_len128-") and changed.seed == 3
  with pytest.raises(ValueError, match="Unknown option.*valid options"):
    data.builder_config("mqar/kv8_len128", {"num_pair": 3})
  with pytest.raises(ValueError, match="query positions"):
    data.builder_config("mqar/kv8_len128", {"length": 20})
  with pytest.raises(ValueError, match="too short"):
    data.builder_config("multikey_retrieval/cpu_demo", {"length": 28})
  with pytest.raises(ValueError, match="min_size"):
    data.builder_config("relation_composition/binary", {"min_size": 11})
