"""make_dataset: determinism, sharding, checkpoint state, errors."""

import grain
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath

import iha_jax.data as data
from iha_jax.data import build

tfds.disable_progress_bar()

NAME = "mqar/kv4_len64"
TINY = {"num_train": 25, "num_validation": 4, "num_test": 4, "num_keys": 32}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  build.main(
    [f"--name={NAME}", f"--data_dir={data_dir}"] + [f"--option={k}={v}" for k, v in TINY.items()]
  )
  return data_dir


def _config(data_dir, **kwargs):
  return {"name": NAME, "seq_len": 64, "data_dir": data_dir, "options": TINY, **kwargs}


def _make(config, **kwargs):
  kwargs = {"global_batch_size": 4, "shard_index": 0, "shard_count": 1, **kwargs}
  return data.make_dataset(config, "train", **kwargs)


def _take(iterator, count):
  batches = [next(iterator) for _ in range(count)]
  iterator.close()
  return batches


def _assert_same(first, second):
  assert len(first) == len(second)
  for a, b in zip(first, second):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def _examples(batches):
  """Multiset of the real (non-padding) rows, as bytes of their inputs."""
  return sorted(
    row.tobytes()
    for batch in batches
    for row, seg in zip(batch["inputs"], batch["segment_ids"])
    if seg.any()
  )


def test_same_seed_same_batches_other_seed_other_order(data_dir):
  config = _config(data_dir)
  first = _take(_make(config, seed=7), 10)  # Crosses epoch boundaries.
  _assert_same(first, _take(_make(config, seed=7), 10))
  other = _take(_make(config, seed=8), 10)
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))
  # 25 examples per epoch: the first 6 batches are 24 distinct ones.
  assert len(set(_examples(first[:6]))) == 24


def test_rows_are_single_padded_examples(data_dir):
  batch = _take(_make(_config(data_dir, seq_len=80)), 1)[0]
  assert {k: v.shape for k, v in batch.items()} == {
    k: (4, 80) for k in ("inputs", "targets", "weights", "segment_ids", "positions")
  }
  real = np.broadcast_to(np.arange(80) < 64, (4, 80))
  np.testing.assert_array_equal(batch["segment_ids"], real)
  np.testing.assert_array_equal(batch["positions"], np.where(real, np.arange(80), 0))
  assert not batch["weights"][~real].any() and not batch["inputs"][~real].any()


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_shards_cover_every_example_exactly_once(data_dir, shuffle):
  source = tfds.data_source(
    f"mqar/{data.builder_config(NAME, TINY).name}", split="train", data_dir=data_dir
  )
  expected = sorted(source[i]["inputs"].tobytes() for i in range(len(source)))
  shards = [
    list(
      data.make_dataset(
        _config(data_dir),
        "train",
        global_batch_size=8,
        shard_index=index,
        shard_count=2,
        shuffle=shuffle,
        num_epochs=1,
      )
    )
    for index in range(2)
  ]
  # 25 examples -> 13 + 12 (+1 padding row) -> 4 batches of 4 on each shard.
  assert [len(batches) for batches in shards] == [4, 4]
  assert all(b["inputs"].shape == (4, 64) for batches in shards for b in batches)
  assert sorted(_examples(shards[0]) + _examples(shards[1])) == expected
  assert set(_examples(shards[0])).isdisjoint(_examples(shards[1]))


@pytest.mark.parametrize("packing", [False, True])
def test_restored_state_continues_with_the_next_batch(data_dir, tmp_path, packing):
  config = _config(data_dir, packing=packing, seq_len=160)
  iterator = _make(config, seed=3)
  for _ in range(5):
    next(iterator)
  # Grain's Orbax handler stores get_state() as JSON, one file per process.
  handler = grain.checkpoint.CheckpointHandler()
  handler.save(epath.Path(tmp_path), item=iterator)
  expected = [next(iterator) for _ in range(4)]
  iterator.close()
  restored = handler.restore(epath.Path(tmp_path), item=_make(config, seed=3))
  _assert_same(expected, _take(restored, 4))
  if packing:
    assert max(b["segment_ids"].max() for b in expected) >= 2


def test_worker_processes_give_the_same_batches_and_resume(data_dir):
  config = _config(data_dir, num_workers=1)
  iterator = _make(config, seed=5)
  first = [next(iterator) for _ in range(3)]
  state = iterator.get_state()
  rest = [next(iterator) for _ in range(2)]
  iterator.close()
  _assert_same(first + rest, _take(_make(_config(data_dir), seed=5), 5))
  restored = _make(config, seed=5)
  restored.set_state(state)
  _assert_same(rest, _take(restored, 2))


def test_config_dict_is_accepted(data_dir):
  config = data.default_config()
  config.update(_config(data_dir))
  assert isinstance(config, ml_collections.ConfigDict)
  _assert_same(_take(_make(config), 2), _take(_make(_config(data_dir)), 2))
  assert data.vocab_size(config) == 3 + 32 + 4096


def test_unknown_dataset_lists_the_available_ones(data_dir):
  available = r"Unknown dataset 'mqar/nope'. Available: .*mqar/kv4_len64.*tfds:"
  with pytest.raises(ValueError, match=available):
    _make(_config(data_dir, name="mqar/nope"))
  with pytest.raises(ValueError, match="Unknown dataset 'tfds:no_such_dataset'"):
    _make(_config(data_dir, name="tfds:no_such_dataset", options={}))


def test_unprepared_dataset_says_how_to_prepare_it(data_dir, tmp_path):
  command = f"python -m iha_jax.data.build --name=mqar/kv4_len64 --data_dir={tmp_path}"
  with pytest.raises(ValueError, match="not prepared") as error:
    _make(_config(str(tmp_path)))
  assert command in str(error.value) and "--option=num_train=25" in str(error.value)
  with pytest.raises(ValueError, match="(?s)No data_dir.*iha_jax.data.build"):
    _make(_config(None))
  with pytest.raises(ValueError, match="(?s)not prepared.*--manual_dir"):
    _make(_config(str(tmp_path), name="local_text/lines", options={}))


def test_bad_arguments_are_reported(data_dir):
  with pytest.raises(ValueError, match=r"no split 'dev'.*'validation'"):
    data.make_dataset(_config(data_dir), "dev", global_batch_size=4)
  with pytest.raises(ValueError, match="multiple of shard_count=2"):
    _make(_config(data_dir), global_batch_size=3, shard_count=2)
  with pytest.raises(ValueError, match="Unknown data config field"):
    _make(_config(data_dir, batch_size=4))
  with pytest.raises(ValueError, match="Unknown option"):
    _make(_config(data_dir, options={"pairs": 3}))
