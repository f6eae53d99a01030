"""Remote workdirs: `gs://` URLs reach Orbax, TFDS and the writers unchanged, no local `gs:`
directory is ever made, and a whole run works on a bucket mounted from a local directory."""

from __future__ import annotations

import json
import os

import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from configs import tiny
from iha_jax import storage
from iha_jax.data import registry
from iha_jax.eval import attention_pictures, evaluate_workdir
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import inputs, train
from iha_jax.train.metrics import MetricsWriter
from tests import fake_bucket


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """`gs://` served from tmp_path/bucket; the test runs in the empty tmp_path/cwd."""
  seen = fake_bucket.mount(monkeypatch, str(tmp_path / "bucket"))
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield {"root": tmp_path / "bucket", "cwd": cwd, **seen}
  assert not os.listdir(cwd), f"a remote path was written locally: {os.listdir(cwd)}"


def test_local_paths_become_absolute_and_urls_stay(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert storage.resolve("runs/a") == str(tmp_path / "runs" / "a")
  assert storage.resolve("~/x") == os.path.expanduser("~/x")
  assert storage.resolve("file:///tmp/x") == "/tmp/x"
  assert storage.resolve("gs://b/run/") == "gs://b/run"
  assert storage.join("gs://b/run", "checkpoints") == "gs://b/run/checkpoints"
  assert storage.parent("gs://b/runs/a") == "gs://b/runs"
  assert storage.basename("gs://b/runs/a/") == "a"
  assert ckpt.checkpoint_dir("gs://b/run") == "gs://b/run/checkpoints"
  assert inputs.resolve_data_dir(tiny.get_config(), "gs://b/runs/a") == "gs://b/runs/data"
  with pytest.raises(ValueError, match=r"--workdir 'memory://x': unsupported URL scheme"):
    storage.resolve("memory://x", name="--workdir")
  assert not os.listdir(tmp_path)


def test_urls_reach_orbax_tfds_and_writers_unchanged(bucket, monkeypatch):
  managers, builders = [], []

  class RecordingManager:
    def __init__(self, directory, options=None):
      managers.append(directory)

  monkeypatch.setattr(ocp, "CheckpointManager", RecordingManager)
  monkeypatch.setattr(tfds, "builder", lambda name, data_dir: builders.append(data_dir))
  ckpt.make_manager("gs://b/run", tiny.get_config())
  registry.get_builder("tfds:c4/en", "gs://b/data")
  task = registry.get_builder("mqar/cpu_demo", "gs://b/data")
  assert [str(d) for d in managers] == ["gs://b/run/checkpoints"]
  assert builders == ["gs://b/data"]
  assert str(task.data_dir).startswith("gs://b/data/mqar/cpu_demo")
  # GCS cannot append: a resumed run's metrics file is rewritten whole, keeping old lines.
  for steps in ((1, 2), (3,)):
    writer = MetricsWriter("gs://b/run", total_steps=3, progress_bar=False)
    for step in steps:
      writer.write(step, {"loss": 1.0 / step})
    writer.close()
  lines = (bucket["root"] / "b" / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
  assert os.listdir(bucket["root"] / "b" / "run" / "tensorboard")  # event files


@pytest.mark.full
def test_a_run_on_a_mounted_bucket(bucket, tmp_path):
  """train, eval and pictures with `gs://` workdir and output dir (data dir local: the
  ArrayRecord reader talks to GCS itself)."""
  config = tiny.get_config()
  config.data.data_dir = str(tmp_path / "data")
  config.train.total_steps, config.checkpoint.every, config.eval_every = 4, 2, 0
  config.mesh.fsdp = 1
  train(config, "gs://bkt/run")
  run = bucket["root"] / "bkt" / "run"
  assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]
  assert bucket["tensorstore"] and all(
    url.startswith("gs://bkt/run/checkpoints/") for url in bucket["tensorstore"]
  )
  record = evaluate_workdir("gs://bkt/run")
  assert record["step"] == 4 and json.loads((run / "eval.json").read_text()) == record
  path = attention_pictures("gs://bkt/run", 1, "gs://bkt/run/pictures")
  assert path == "gs://bkt/run/pictures/run_layer1.png"
  assert (run / "pictures" / "run_layer1.png").read_bytes()[:4] == b"\x89PNG"
  steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]
