"""Training loop on 8 fake CPU devices: learning, sharding invariance, resume, restore, NaN."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from iha_jax import parallel
from iha_jax.eval import evaluate_workdir
from iha_jax.models import FunctionalTransformerLM
from iha_jax.train import ConfigError, NonFiniteLossError, integrity, train
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import config as config_lib
from iha_jax.train.loop import _Preemption
from iha_jax.train.metrics import MetricsWriter
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import abstract_state
from iha_jax.workdir_lock import WorkdirBusyError
from tests.fixtures import REPO_ROOT, tiny_config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


def losses(workdir: str) -> dict[int, float]:
  """Step -> loss from metrics.jsonl (the last record of a step wins)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      out[record["step"]] = record["loss"]
  return out


@pytest.fixture(scope="module")
def reference_run(data_dir, tmp_path_factory):
  """An uninterrupted 8-step run on one device, checkpoints every 4 steps."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  config = tiny_config(data_dir, train__total_steps=8, checkpoint__every=4, mesh__fsdp=1)
  train(config, workdir)
  return config, workdir


@pytest.mark.full
def test_loss_falls(data_dir, tmp_path):
  config = tiny_config(
    data_dir, train__total_steps=40, train__learning_rate=1e-2, checkpoint__every=40
  )

  def embedding_norm(step, state):  # a user's metric, added without editing the loop
    return {"embedding_norm": float(jnp.linalg.norm(state.params["embedding"])), "hook_step": step}

  final = train(config, str(tmp_path), hooks=[embedding_norm])
  curve = losses(str(tmp_path))
  assert len(curve) == 40
  first, last = np.mean([curve[s] for s in (1, 2, 3)]), np.mean([curve[s] for s in (38, 39, 40)])
  assert last < first - 0.5, (first, last)
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  for key in (
    "loss",
    "grad_norm",
    "learning_rate",
    "tokens_per_sec",
    "tflops_per_sec_per_device",
    "mfu",
    "embedding_norm",
  ):
    assert np.isfinite(records[0][key]) and records[0][key] >= 0, key
  assert all(r["hook_step"] == r["step"] for r in records)
  assert final["embedding_norm"] != records[0]["embedding_norm"]  # the state it saw moved
  assert os.listdir(tmp_path / "tensorboard")


@pytest.mark.parametrize(
  "mesh",
  [
    dict(data=1, fsdp=8, tensor=1),
    pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.full),
  ],
)
def test_sharded_losses_match_one_device(reference_run, tmp_path, mesh):
  config, workdir = reference_run
  config = tiny_config(config.data.data_dir, train__total_steps=8, checkpoint__every=8)
  config.mesh.update(**mesh)
  train(config, str(tmp_path))
  expected, actual = losses(workdir), losses(str(tmp_path))
  assert sorted(actual) == list(range(1, 9))
  np.testing.assert_allclose(
    [actual[s] for s in sorted(actual)], [expected[s] for s in sorted(actual)], rtol=2e-5
  )


def test_resume_reproduces_uninterrupted_run(reference_run, tmp_path):
  config, workdir = reference_run
  # The "interrupted" run: only the step-4 checkpoint survives.
  shutil.copytree(
    os.path.join(workdir, "checkpoints", "4"), os.path.join(tmp_path, "checkpoints", "4")
  )
  train(config, str(tmp_path))
  expected, resumed = losses(workdir), losses(str(tmp_path))
  assert sorted(resumed) == [5, 6, 7, 8]
  assert [resumed[s] for s in (5, 6, 7, 8)] == [expected[s] for s in (5, 6, 7, 8)]


@pytest.mark.full
def test_restore_onto_another_mesh(data_dir, tmp_path):
  """fsdp=8 -> data=2 x tensor=4: same values, new shardings, same continued losses."""
  # Vocabulary 88: the data's 86 padded, so that tensor=4 splits it.
  config = tiny_config(
    data_dir, train__total_steps=6, checkpoint__every=3, mesh__fsdp=8, model__vocab_size=88
  )
  first = str(tmp_path / "fsdp8")
  train(config, first)
  other = str(tmp_path / "dp2_tp4")
  shutil.copytree(os.path.join(first, "checkpoints", "3"), os.path.join(other, "checkpoints", "3"))
  config.mesh.update(data=2, fsdp=1, tensor=4)
  model = FunctionalTransformerLM(config_lib.validate(config, 8))
  mesh = parallel.create_mesh(dict(config.mesh))
  target, shardings = abstract_state(model, make_optimizer(config.train), mesh)
  manager = ckpt.make_manager(first)
  saved = ckpt.restore(
    manager,
    6,
    abstract_state(
      model, make_optimizer(config.train), parallel.create_mesh(dict(data=1, fsdp=8, tensor=1))
    )[0],
  )
  moved = ckpt.restore(manager, 6, target)
  manager.close()
  wq = moved.params["layers"]["0"]["attn"]["wq"]
  assert wq.sharding.spec == shardings.params["layers"]["0"]["attn"]["wq"].spec
  assert "tensor" in str(wq.sharding.spec)
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  train(config, other)
  expected, actual = losses(first), losses(other)
  np.testing.assert_allclose(
    [actual[s] for s in (4, 5, 6)], [expected[s] for s in (4, 5, 6)], rtol=2e-5
  )


def test_restore_with_incompatible_model_fails(reference_run, tmp_path):
  config, workdir = reference_run
  shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(tmp_path, "checkpoints"))
  config = tiny_config(
    config.data.data_dir,
    train__total_steps=8,
    mesh__fsdp=1,
    model__mlp_dim=128,
    model__num_pseudo=4,
  )
  with pytest.raises(ConfigError, match=r"model\.mlp_dim: 64 \(checkpoint\) vs 128") as e:
    train(config, str(tmp_path))
  assert "model.num_pseudo" in str(e.value)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
  config = tiny_config(
    data_dir,
    train__total_steps=20,
    train__learning_rate=1e38,
    train__warmup_steps=0,
    train__grad_clip=0.0,
    checkpoint__every=1,
  )
  with pytest.raises(NonFiniteLossError) as e:
    train(config, str(tmp_path))
  manager = ckpt.make_manager(str(tmp_path))
  last_good = manager.latest_step()
  message = str(e.value)
  assert re.match(rf"step {last_good + 1}: the (loss|gradient norm) is (nan|inf)", message)
  assert f"Last good checkpoint: step {last_good} in {tmp_path}" in message
  assert "Try a lower train.learning_rate (now 1e+38), or gradient clipping" in message
  model = FunctionalTransformerLM(config_lib.validate(config, 8))
  target, _ = abstract_state(
    model, make_optimizer(config.train), parallel.create_mesh(dict(config.mesh))
  )
  state = ckpt.restore(manager, last_good, target)
  manager.close()
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  assert max(losses(str(tmp_path))) == last_good


def test_eval_workdir_writes_metrics(reference_run):
  _, workdir = reference_run
  record = evaluate_workdir(workdir, "test")
  assert record["step"] == 8 and record["examples"] == 32
  # 3 answer tokens per example: an exact match needs all of them right.
  assert 0.0 <= record["exact_match"] <= record["token_accuracy"] <= 1.0
  assert record["loss"] > 0
  assert np.isclose(record["perplexity"], np.exp(record["loss"]))
  with open(os.path.join(workdir, "eval.json"), encoding="utf-8") as f:
    assert json.load(f) == record


def test_unreadable_latest_checkpoint_falls_back_to_the_newest_intact_step(
  reference_run, tmp_path, caplog
):
  """Step 8's arrays truncated (a half-copied checkpoint): eval and training warn, name
  step 8 and use step 4; training moves step 8 aside and makes it again, loss for loss."""
  config, workdir = reference_run
  copy = str(tmp_path / "run")
  shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(copy, "checkpoints"))
  for root, _, files in os.walk(os.path.join(copy, "checkpoints", "8", "state")):
    for name in files:
      if os.path.basename(root) == "d":  # array chunks
        open(os.path.join(root, name), "wb").close()
  with caplog.at_level("WARNING"):
    assert evaluate_workdir(copy)["step"] == 4
  assert "checkpoint step 8 in" in caplog.text and "cannot be read" in caplog.text
  train(config, copy)
  assert os.path.isdir(os.path.join(copy, ckpt.UNREADABLE_DIR, "8"))
  assert sorted(losses(copy)) == [5, 6, 7, 8]
  assert [losses(copy)[s] for s in (5, 6, 7, 8)] == [losses(workdir)[s] for s in (5, 6, 7, 8)]
  assert evaluate_workdir(copy)["step"] == 8


def _corrupt_silently(step_dir: str, count: int = 64) -> set[str]:
  """Overwrites `count` bytes of a step's array data where Orbax still restores it without
  an error, as wrong values: the silent damage checksums exist for (a hit on compressed
  or index bytes makes the step unreadable instead: the test above). OCDBT's file layout
  differs between runs, so the place is searched: the largest data files first, several
  offsets in each. Returns the names of the arrays whose values changed."""
  state = os.path.join(step_dir, "state")

  def read():
    with ocp.PyTreeCheckpointer() as checkpointer:
      return checkpointer.restore(state)

  clean = jax.tree_util.tree_leaves_with_path(read())
  files = [
    os.path.join(root, name)
    for root, _, names in os.walk(state)
    for name in names
    if os.path.basename(root) == "d"
  ]
  for path in sorted(files, key=os.path.getsize, reverse=True):
    with open(path, "rb") as f:
      original = f.read()
    for fraction in (0.5, 0.3, 0.7, 0.1, 0.9):
      offset = int(len(original) * fraction)
      with open(path, "wb") as f:
        f.write(original[:offset] + b"\xa5" * count + original[offset + count :])
      try:
        damaged = jax.tree.leaves(read())
      except Exception:  # pylint: disable=broad-except  # unreadable: try elsewhere
        damaged = None
      if damaged is not None:
        changed = {
          integrity.leaf_name(p)
          for (p, a), b in zip(clean, damaged)
          if not np.array_equal(np.asarray(a), np.asarray(b))
        }
        if changed:
          return changed
      with open(path, "wb") as f:
        f.write(original)
  raise AssertionError(f"no silent corruption found in {state}")


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # the unverified reads
def test_corrupt_array_bytes_fail_their_checksums_then_a_full_disk_keeps_step_4(
  reference_run, tmp_path, monkeypatch, caplog
):
  """64 bytes overwritten in step 8's array data restore through Orbax without an error, as
  wrong values; the checksums name exactly the damaged arrays, and training warns in one
  line, sets step 8 aside and resumes from step 4, loss for loss.

  Then a simulated full disk: the save of step 8 raises what Orbax raised on a full 900 KiB
  tmpfs (TensorStore's RESOURCE_EXHAUSTED "No space left on device") after writing part of
  the step. One DiskFullError names the step, the directory, the bytes a checkpoint takes
  (step 4's files) and the bytes free; the partial step is deleted, step 4 kept, the lock
  released."""
  config, workdir = reference_run
  copy = str(tmp_path / "run")
  shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(copy, "checkpoints"))
  changed = _corrupt_silently(os.path.join(copy, "checkpoints", "8"))
  step4_bytes = sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(os.path.join(copy, "checkpoints", "4"))
    for name in names
  )

  def full_disk(self, step, *args, **kwargs):
    partial = os.path.join(copy, "checkpoints", f"{step}{ckpt.TMP_SUFFIX}", "state")
    os.makedirs(partial)
    with open(os.path.join(partial, "_sharding"), "wb") as f:
      f.write(b"x" * 4096)
    raise ValueError(
      f'RESOURCE_EXHAUSTED: Error writing local file "{partial}/_sharding": Failed to write '
      "24370 bytes to file 16: No space left on device [os_error_code='28']"
    )

  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
  with caplog.at_level("WARNING"), pytest.raises(ckpt.DiskFullError) as e:
    train(config, copy)
  warnings = [r.getMessage() for r in caplog.records if "step 8 in" in r.getMessage()]
  assert len(warnings) == 1, warnings
  assert f"fails its checksums (ChecksumMismatch: {len(changed)} of " in warnings[0]
  named = warnings[0].split(" (", 2)[2].split(")")[0].removesuffix(", ...").split(", ")
  assert set(named) <= changed and len(named) == min(3, len(changed))
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
  assert os.listdir(os.path.join(copy, ckpt.UNREADABLE_DIR)) == ["8"]
  assert [losses(copy)[s] for s in (5, 6, 7, 8)] == [losses(workdir)[s] for s in (5, 6, 7, 8)]
  assert str(e.value).startswith(
    f"no space left on the device writing checkpoint step 8 to {copy}/checkpoints (its "
    f"partial files are deleted): a checkpoint takes about {step4_bytes:,} bytes, "
  )
  assert "step 4 is kept and a rerun resumes from it" in str(e.value)
  assert os.listdir(os.path.join(copy, "checkpoints")) == ["4"]
  assert not os.listdir(os.path.join(copy, "lock"))


def test_eval_reads_a_locked_workdir_and_verifies_parameters(reference_run, tmp_path, caplog):
  """Another live run holds the workdir's lock: eval reads anyway (no lock) and skips step 8,
  whose saved checksum of the embedding no longer matches; train() refuses, naming the
  holder, until that process is gone. A checkpoint without checksums restores unverified,
  with a warning."""
  config, workdir = reference_run
  copy = str(tmp_path / "run")
  shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(copy, "checkpoints"))
  sums = os.path.join(copy, "checkpoints", "8", ckpt.CHECKSUMS, "metadata")
  with open(sums, encoding="utf-8") as f:
    saved = json.load(f)
  saved["state"]["params/embedding"] = "0" * 16
  with open(sums, "w", encoding="utf-8") as f:
    json.dump(saved, f)
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  try:
    os.makedirs(os.path.join(copy, "lock"))
    with open(os.path.join(copy, "lock", "00000001.json"), "w", encoding="utf-8") as f:
      json.dump({"host": socket.gethostname(), "pid": holder.pid, "heartbeat": time.time()}, f)
    with caplog.at_level("WARNING"):
      assert evaluate_workdir(copy)["step"] == 4
    pattern = r"step 8 in .* 1 of \d+ parameter arrays differ .*\(params/embedding\)"
    assert re.search(pattern, caplog.text)
    with pytest.raises(
      WorkdirBusyError, match=rf"another training run: host .*, pid {holder.pid},"
    ):
      train(config, copy)
  finally:
    holder.kill()
    holder.wait()
  shutil.rmtree(os.path.join(copy, "checkpoints", "4", ckpt.CHECKSUMS))
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert evaluate_workdir(copy, step=4)["step"] == 4
  assert "checkpoint step 4 in" in caplog.text and "has no checksums" in caplog.text


def test_sigterm_and_ctrl_c_request_a_save(monkeypatch):
  """Both signals set the same flag the loop checks after each step; a second Ctrl-C
  stops at once; closing restores the previous handlers."""
  previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  for sig in (signal.SIGTERM, signal.SIGINT):
    preemption = _Preemption()
    try:
      assert not preemption.agreed()
      signal.raise_signal(sig)
      assert preemption.agreed()
      if sig == signal.SIGINT:
        with pytest.raises(KeyboardInterrupt):
          signal.raise_signal(sig)
    finally:
      preemption.close()
  assert {sig: signal.getsignal(sig) for sig in previous} == previous


def test_progress_bar_keeps_eval_results_on_screen(tmp_path, capsys):
  writer = MetricsWriter(str(tmp_path), total_steps=4, progress_bar=True)
  writer.write(1, {"loss": 2.5})
  writer.write(2, {"loss": 2.0, "eval_loss": 1.5, "eval_exact_match": 0.25})
  writer.close()
  out = capsys.readouterr().out
  assert "step 2: eval_loss=1.5, eval_exact_match=0.25" in out
  assert "step 1" not in out  # training steps only update the bar


@pytest.mark.full
def test_ctrl_c_saves_current_step_and_exits_cleanly(data_dir, tmp_path):
  """Ctrl-C (SIGINT) to a running train.py saves a checkpoint and exits with 0, as SIGTERM
  (preemption) does: both go through the same flag (test above). While it runs, a second
  train.py on its workdir refuses in one line naming it, and writes nothing there."""
  workdir = str(tmp_path / "preempted")
  repo = str(REPO_ROOT)
  env = dict(os.environ, PYTHONPATH=repo, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  env.pop("IHA_DEBUG", None)
  command = [
    sys.executable,
    "train.py",
    "--config",
    "configs/tiny.py",
    "--workdir",
    workdir,
    f"--config.data.data_dir={data_dir}",
    "--config.train.total_steps=100000",
    "--config.checkpoint.every=100000",
    "--config.eval_every=0",
  ]
  proc = subprocess.Popen(
    command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
  )
  try:
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 240
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
      assert proc.poll() is None, proc.stderr.read()[-3000:]
      assert time.time() < deadline, "train.py logged no step within 240 s"
      time.sleep(0.5)
    second = subprocess.run(
      command, cwd=repo, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert second.returncode == 1, second.stderr[-3000:]
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith(
      f"train.py: error: WorkdirBusyError: --workdir '{workdir}' is in use by another training "
      f"run: host {socket.gethostname()}, pid {proc.pid}, "
    ), line
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, stderr[-3000:]
  manager = ckpt.make_manager(workdir)
  saved = manager.latest_step()
  manager.close()
  assert saved is not None and 0 < saved < 100000
  assert saved >= max(losses(workdir))  # the save is at (or after) the last logged step
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(1, len(steps) + 1))  # one run's records only
  assert os.listdir(os.path.join(workdir, "lock")) == []


@pytest.mark.full
def test_init_from_starts_a_longer_run_on_a_context_mesh(reference_run, data_dir, tmp_path):
  """The long-context stage's path at small size: another run's newest parameters, across
  twice the sequence length, a new mesh (fsdp 4 x context 2, balanced layout) and a new
  RoPE base; step 0 and a fresh optimizer; it trains. A key that shapes parameters and
  differs is refused, naming it."""
  from iha_jax.train.loop import Trainer  # pylint: disable=import-outside-toplevel

  _, source = reference_run
  config = tiny_config(
    data_dir,
    train__total_steps=2,
    train__warmup_steps=1,
    train__init_from=source,
    mesh__fsdp=4,
    mesh__context=2,
    mesh__context_load_balance=True,
    checkpoint__every=2,
  )
  config.data.seq_len = 96
  config.model.rope_theta = 40000.0
  trainer = Trainer(config, str(tmp_path / "long"))
  manager = ckpt.make_manager(source)
  expected = ckpt.restore_params(manager, 8, trainer.target).params
  manager.close()
  assert int(trainer.state.step) == 0
  for got, want in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if np.ndim(x) > 0]
  assert moments and not any(np.any(np.asarray(m)) for m in moments)  # fresh: zeros
  record = trainer.run()
  assert np.isfinite(record["loss"]) and ckpt.complete_steps(str(tmp_path / "long")) == [2]
  bad = tiny_config(data_dir, train__init_from=source, model__num_layers=3)
  with pytest.raises(ConfigError, match=r"model.num_layers: 2 \(checkpoint\) vs 3"):
    Trainer(bad, str(tmp_path / "bad"))
