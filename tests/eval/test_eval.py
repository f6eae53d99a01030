"""eval.py on 8 fake CPU devices: metrics, mesh choice, length sweep, attention pictures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs.default import get_config as default_config
from iha_jax.eval import (
  attention_pictures,
  evaluate_workdir,
  length_sweep,
  parse_lengths,
  parse_mesh,
  restore_run,
)
from iha_jax.eval.runs import FALLBACK_MESH, chance_exact_match, choose_mesh
from iha_jax.eval.sweep import plot_sweep, sweep_title
from iha_jax.models import FunctionalTransformerLM
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import model_config, train
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import abstract_state
from tests.fixtures import REPO_ROOT, tiny_config
from tests.utils import decode_png

REPO = str(REPO_ROOT)
LENGTHS = [32, 48, 96]  # The tiny task trains at 48.


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
  """A tiny IHA run ("IM", P=2, fsdp=8) and its MHA twin ("MM"): 4 steps each."""
  root = tmp_path_factory.mktemp("runs")
  data_dir = str(root / "data")
  workdirs = {}
  for name, overrides in (
    ("iha", {}),
    ("mha", dict(model__attention_schedule="MM", model__num_pseudo=None)),
  ):
    workdirs[name] = str(root / name)
    train(
      tiny_config(
        data_dir,
        train__total_steps=4,
        checkpoint__every=4,
        log_every=0,
        model__vocab_size=88,  # the data's 86 padded: the runs are restored onto tensor=4
        **overrides,
      ),
      workdirs[name],
    )
  return workdirs


def test_eval_writes_metrics(runs):
  record = evaluate_workdir(runs["iha"])
  with open(os.path.join(runs["iha"], "eval.json"), encoding="utf-8") as f:
    assert json.load(f) == record
  assert record["step"] == 4 and record["split"] == "test" and record["examples"] == 32
  assert record["mesh"] == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}  # saved, fits
  for key in ("loss", "perplexity", "token_accuracy", "exact_match", "chance_exact_match"):
    assert isinstance(record[key], float) and np.isfinite(record[key]), key
  assert 0.0 <= record["exact_match"] <= record["token_accuracy"] <= 1.0
  assert np.isclose(record["perplexity"], np.exp(record["loss"]))


def test_restore_onto_another_mesh(runs):
  """Saved on fsdp=8, restored onto data=2 x context=2 x tensor=2 (the sequence split over
  devices too): same parameters, same metrics."""
  saved = restore_run(runs["iha"])
  moved = restore_run(runs["iha"], mesh=parse_mesh("data:2,context:2,tensor:2"))
  wq = moved.params["layers"]["0"]["attn"]["wq"]
  assert dict(moved.mesh.shape) == {"data": 2, "fsdp": 1, "context": 2, "tensor": 2}
  assert "tensor" in str(wq.sharding.spec)
  np.testing.assert_array_equal(
    np.asarray(wq), np.asarray(saved.params["layers"]["0"]["attn"]["wq"])
  )
  expected = saved.evaluate(saved.config, "test")
  actual = moved.evaluate(moved.config, "test")
  assert actual["examples"] == expected["examples"]
  np.testing.assert_allclose(actual["loss"], expected["loss"], rtol=1e-5)
  assert actual["exact_match"] == expected["exact_match"]


def test_eval_restores_parameters_without_optimizer_state(runs):
  """eval reads step + params only; they equal a full restore of the same checkpoint."""
  run = restore_run(runs["iha"])
  manager = ckpt.make_manager(runs["iha"])
  try:
    target, _ = abstract_state(run.model, make_optimizer(run.config.train), run.mesh)
    full = ckpt.restore(manager, run.step, target)
    partial = ckpt.restore_params(manager, run.step, target)
  finally:
    manager.close()
  assert all(
    leaf is ocp.PLACEHOLDER
    for leaf in jax.tree.leaves(partial.opt_state, is_leaf=lambda x: x is ocp.PLACEHOLDER)
  )
  assert any(np.any(np.asarray(m) != 0) for m in jax.tree.leaves(full.opt_state))
  assert int(partial.step) == int(full.step) == run.step == 4
  for got, want, from_eval in zip(
    jax.tree.leaves(partial.params), jax.tree.leaves(full.params), jax.tree.leaves(run.params)
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(from_eval), np.asarray(want))


def test_chance_exact_match_per_task():
  config = default_config()
  assert chance_exact_match(config) == 64.0**-8  # mqar/cpu_demo: 8 queries, 64 values
  config.data.name = "multikey_retrieval/cpu_demo"
  config.data.options = {"length": 64, "key_len": 1, "value_len": 2, "num_queries": 2}
  assert chance_exact_match(config) == 32.0**-4  # 32 value tokens, 2 x 2 answer tokens
  config.data.name = "local_text/lines"
  assert chance_exact_match(config) is None


def test_mesh_choice(runs):
  model = model_config(restore_run(runs["mha"]).config)
  saved = {"data": 1, "fsdp": 16, "tensor": 1}  # A 16-device run evaluated on 8 devices.
  assert choose_mesh(saved, model, 8) == FALLBACK_MESH
  assert choose_mesh(dict(FALLBACK_MESH), model, 8) == FALLBACK_MESH
  assert parse_mesh("fsdp:-1") == FALLBACK_MESH
  with pytest.raises(ValueError, match=r"--mesh .* does not fit 8 devices.*num_heads=4"):
    choose_mesh(FALLBACK_MESH, model, 8, override=parse_mesh("tensor:8"))
  with pytest.raises(ValueError, match=r"--mesh='pipe:2': unknown axis 'pipe'"):
    parse_mesh("pipe:2")
  with pytest.raises(ValueError, match=r"--mesh='fsdp:x': fsdp needs an integer"):
    parse_mesh("fsdp:x")


@pytest.mark.parametrize("scan_layers,remat", [(False, "none"), (True, "full")])
def test_module_holds_the_parameters(scan_layers, remat):
  """`FunctionalTransformerLM.module` (used for the pictures) inverts the layout, and the trainer's
  scanned, rematerialised forward pass is `TransformerLM`'s."""
  config = tiny_config("unused", model__num_layers=3)  # "IM" scanned: 1 period + 1 tail.
  model = FunctionalTransformerLM(model_config(config), remat=remat, scan_layers=scan_layers)
  params = model.init(3)
  tokens = np.arange(10, dtype=np.int32)[None] % 7
  np.testing.assert_allclose(
    np.asarray(model.module(params)(tokens)),
    np.asarray(model.apply(params, tokens)),
    rtol=1e-5,
    atol=1e-5,
  )


@pytest.mark.full
def test_length_sweep_writes_json_and_plot(runs, tmp_path):
  """The retrieval sweep at longer contexts, run with every sequence split over 4 devices
  (the long-context mesh); at the training length it gives the plain evaluation's numbers."""
  out = str(tmp_path / "sweep")
  result = length_sweep(
    [runs["iha"], runs["mha"]],
    [str(n) for n in LENGTHS],
    out,
    num_examples=32,
    mesh=parse_mesh("fsdp:2,context:4"),
  )
  with open(os.path.join(out, "length_sweep.json"), encoding="utf-8") as f:
    assert json.load(f) == result
  assert result["lengths"] == LENGTHS and result["examples"] == 32
  assert list(result["runs"]) == ["iha", "mha"]
  assert result["runs"]["iha"]["label"] == "iha (IM, P=2)"
  assert result["runs"]["mha"]["label"] == "mha (MM)"
  assert {r["dataset"] for r in result["runs"].values()} == {"multikey_retrieval/cpu_demo"}
  assert sweep_title(result) == (
    "Multi-key retrieval (multikey_retrieval/cpu_demo) against context length"
  )
  assert sweep_title({"runs": {"a": {"dataset": "mqar/cpu_demo"}}}).startswith(
    "Multi-query associative recall (mqar/cpu_demo)"
  )
  for record in result["runs"].values():
    assert record["step"] == 4 and record["train_length"] == 48
    assert sorted(record["exact_match"]) == sorted(str(n) for n in LENGTHS)
    for n in map(str, LENGTHS):
      assert 0.0 <= record["exact_match"][n] <= record["token_accuracy"][n] <= 1.0
  # At the training length the sweep's task is the training task (example i of a split
  # does not depend on the split sizes): the plain evaluation's numbers, exactly.
  plain = evaluate_workdir(runs["mha"])
  assert result["runs"]["mha"]["token_accuracy"]["48"] == plain["token_accuracy"]
  assert result["runs"]["mha"]["exact_match"]["48"] == plain["exact_match"]
  decode_png(os.path.join(out, "length_sweep.png"))
  fig = plot_sweep(result, str(tmp_path / "again.png"))  # the plotted lines are the data
  lines = [line for line in fig.axes[0].lines if line.get_marker() == "o"]
  assert [line.get_label() for line in lines] == ["iha (IM, P=2)", "mha (MM)"]
  for line, record in zip(lines, result["runs"].values()):
    assert list(line.get_xdata()) == LENGTHS
    assert list(line.get_ydata()) == [record["exact_match"][str(n)] for n in LENGTHS]


def test_attention_pictures(runs, tmp_path):
  path = attention_pictures(runs["iha"], 1, str(tmp_path))  # layers count from 1
  assert path == str(tmp_path / "iha_layer1.png")
  decode_png(path)


@pytest.mark.full
def test_cli_attention_pictures_of_both_runs(runs, tmp_path):
  """The real CLI, once: pictures of an IHA layer and of an MHA layer (layers counted
  from 1)."""
  out = tmp_path / "pictures"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "eval.py"),
      f"--workdir={runs['iha']}",
      f"--workdir={runs['mha']}",
      "--attention_layer_number=2",
      f"--out_dir={out}",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  decode_png(str(out / "iha_layer2.png"))
  decode_png(str(out / "mha_layer2.png"))


@pytest.mark.parametrize(
  "call,message",
  [
    (
      lambda runs, out: evaluate_workdir(os.path.join(out, "missing")),
      r"--workdir '.*missing' is not a directory",
    ),
    (lambda runs, out: evaluate_workdir(out), r"--workdir '.*': no checkpoint"),
    (lambda runs, out: evaluate_workdir(runs["iha"], step=3), r"--step=3: .* steps \[4\]"),
    (
      lambda runs, out: length_sweep([runs["iha"]], [], out),
      r"--sweep_lengths must list at least one",
    ),
    (lambda runs, out: parse_lengths(["128", "x"]), r"--sweep_lengths must be integers"),
    (lambda runs, out: parse_lengths(["0"]), r"--sweep_lengths must be positive"),
    (
      lambda runs, out: length_sweep([runs["iha"]], [48], out, num_examples=0),
      r"--sweep_examples must be a positive integer",
    ),
    (
      lambda runs, out: attention_pictures(runs["iha"], 3, out),
      r"--attention_layer_number=3 is out of range: .* has 2 layers \(1..2\)",
    ),
  ],
)
def test_bad_arguments_name_the_flag(runs, tmp_path, call, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    call(runs, str(tmp_path))
