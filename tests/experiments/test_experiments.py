"""The study runner end to end at `--scale tiny`: variants trained over their grid and
seeds, the JSON / Markdown / PNG written from them, resumption, and controls that must
learn (2 x 2 relation composition, MQAR with one pair), so a broken pipeline fails here.
Each study runs a subset of its variants: a variant is a schedule letter of the same
model (every letter trains in tests/train/test_step.py), so more variants add time, not
coverage."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np
import pytest

from experiments import protocol, quality_cost, report, run
from experiments.studies import STUDIES
from experiments.variant_runs import RunResult
from tests.utils import decode_png

SEEDS = 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("data"))


def _tiny_args(study: str, out: str, data_dir: str, variants: Sequence[str] = ()) -> list[str]:
  """`experiments.run` arguments of a quiet `--scale tiny` run (all variants by default)."""
  args = [study, "--scale", "tiny", "--seeds", str(SEEDS), "--out", out, "--data_dir", data_dir]
  return [*args, "--quiet", *(["--variants", ",".join(variants)] if variants else [])]


def _check_outputs(
  out: str, name: str, variants: list[str], control: tuple[str, float] = ("token_accuracy", 0.9)
) -> dict:
  """Checks the JSON, Markdown and PNG of a tiny study; every variant's base runs must
  reach `control` (test metric, minimum): the control task learns."""
  with open(os.path.join(out, f"{name}.json")) as f:
    data = json.load(f)
  study = STUDIES[name]
  for variant in variants:
    chosen = data["chosen_learning_rates"][variant]
    assert chosen in study.scales["tiny"].learning_rates
    grid = [r for r in data["runs"].values() if r["variant"] == variant and r["phase"] == "grid"]
    assert sorted(r["learning_rate"] for r in grid) == sorted(study.scales["tiny"].learning_rates)
    at_rate = [
      r
      for r in data["runs"].values()
      if r["variant"] == variant and r["learning_rate"] == chosen and r["sweep"] is None
    ]
    assert sorted(r["seed"] for r in at_rate) == list(range(SEEDS))
    for r in at_rate:  # budgets and both splits are recorded
      assert r["params"] > 0 and r["attention_flops_per_token"] > 0 and r["steps"] > 0
      # Whole-model training FLOPs: 3x the forward, of which attention is one part.
      tokens = r["batch_size"] * r["seq_len"]
      assert r["train_flops_per_step"] > 3 * r["attention_flops_per_token"] * tokens
      assert set(r["test"]) == set(r["validation"]) >= {"loss", "token_accuracy", "exact_match"}
      assert r["curve"] and r["curve"][-1]["step"] <= r["steps"]
      # The control learns: every variant, every seed.
      assert r["test"][control[0]] >= control[1], (variant, r["seed"], r["test"])
  with open(os.path.join(out, f"{name}.md")) as f:
    md = f.read()
  labels = {r["variant"]: r["label"] for r in data["runs"].values()}
  for variant in variants:
    row = next(line for line in md.splitlines() if line.startswith(f"| {labels[variant]} |"))
    assert row.count("±") == len(study.metrics)  # mean ± std per metric
    assert row.count(",") >= len(study.metrics) * (SEEDS - 1)  # per-seed values
  assert "The paper:" in md and "Regenerate:" in md
  fig = report.plot(study, data, os.path.join(out, "again.png"))
  decode_png(os.path.join(out, f"{name}.png"), dpi=110, figure=fig)
  # The bars are the test metric's means over the seeds at each variant's chosen rate.
  metric = study.metrics[0]
  expected = [
    100
    * np.mean(
      [
        report.metric_value(r["test"], metric)
        for r in data["runs"].values()
        if r["variant"] == v
        and r["sweep"] is None
        and r["learning_rate"] == data["chosen_learning_rates"][v]
      ]
    )
    for v in dict.fromkeys(r["variant"] for r in data["runs"].values())
  ]
  np.testing.assert_allclose([bar.get_height() for bar in fig.axes[0].patches], expected)
  return data


@pytest.mark.full
def test_relcomp_binary_tiny_learns_with_both_models(tmp_path, data_dir):
  """IHA as the one-layer encoder and MHA in the decoder-only rendering (the study's two
  renderings)."""
  out = str(tmp_path)
  variants = ["iha", "mha_decoder"]
  run.main(_tiny_args("relcomp_binary", out, data_dir, variants))
  _check_outputs(out, "relcomp_binary", variants)


MQAR_VARIANTS = ["iha"]  # (the other studies run two variants side by side)


@pytest.mark.full
def test_mqar_tiny_with_sweep_and_resume(tmp_path, data_dir, monkeypatch):
  out = str(tmp_path)
  args = _tiny_args("mqar", out, data_dir, MQAR_VARIANTS)
  run.main(args)
  data = _check_outputs(out, "mqar", MQAR_VARIANTS)
  sweep = [r for r in data["runs"].values() if r["sweep"]]
  assert {(r["sweep"]["axis"], r["sweep"]["value"]) for r in sweep} == {("num_pairs", 2)}
  assert len(sweep) == SEEDS * len(MQAR_VARIANTS)
  # Sweeps run after every variant's grid and seeds (a stopped study still compares all).
  phases = [r["phase"] for r in data["runs"].values()]
  assert phases.index("sweep") == len(phases) - len(sweep)
  with open(os.path.join(out, "mqar.md")) as f:
    assert "Sweep over `num_pairs`" in f.read()
  # A rerun trains nothing: every run is found in the JSON.
  monkeypatch.setattr(
    protocol, "CompiledVariant", lambda *a, **k: pytest.fail("a finished run was trained again")
  )
  run.main(args)


@pytest.mark.full
def test_relcomp_ternary_tiny_subset(tmp_path, data_dir):
  out = str(tmp_path)
  run.main(_tiny_args("relcomp_ternary", out, data_dir, ["iha"]))
  _check_outputs(out, "relcomp_ternary", ["iha"])
  with pytest.raises(ValueError, match="no variant"):
    run.main(["relcomp_ternary", "--scale", "tiny", "--out", out, "--variants", "gpt"])


@pytest.mark.full
def test_cpm3_tiny_sweeps_the_heads(tmp_path, data_dir):
  out = str(tmp_path)
  # Attention-only blocks; the control is IHA's (MHA shares its code path, see the study).
  run.main(_tiny_args("cpm3", out, data_dir, ["iha_n2"]))
  data = _check_outputs(out, "cpm3", ["iha_n2"])
  # The head count is swept with a rate re-tuned at each point: the grid on seed 0 there,
  # then every seed at the point's best rate.
  grid = [r for r in data["runs"].values() if r["phase"] == "sweep_grid"]
  assert sorted(r["learning_rate"] for r in grid) == sorted(
    STUDIES["cpm3"].scales["tiny"].learning_rates
  )
  rate = data["sweep_rates"]["iha_n2/num_heads=1"]
  assert rate == protocol.choose_rate(grid, "token_accuracy")
  sweep = [r for r in data["runs"].values() if r["sweep"] and r["learning_rate"] == rate]
  assert sorted((r["variant"], r["sweep"]["value"], r["seed"]) for r in sweep) == sorted(
    ("iha_n2", 1, seed) for seed in range(SEEDS)
  )
  with open(os.path.join(out, "cpm3.md")) as f:
    md = f.read()
  assert "Rates re-tuned at each `num_heads` point" in md
  assert f"| IHA, P = H, n = 2 | {rate:g} | " in md.split("Rates re-tuned")[1]
  base = {r["variant"]: r for r in data["runs"].values() if not r["sweep"]}
  for r in sweep:  # one head of the same width instead of two: fewer parameters, FLOPs
    assert r["params"] < base[r["variant"]]["params"]
    assert r["attention_flops_per_token"] < base[r["variant"]]["attention_flops_per_token"]
  with pytest.raises(ValueError, match="at scale tiny"):  # variants are per scale
    run.main(_tiny_args("cpm3", out, data_dir, ["iha_n8"]))
  # `cpm3_mlp` is the same study with an MLP in the block: more parameters, same data.
  mlp = STUDIES["cpm3_mlp"].scales["tiny"].variants[0]
  plain = STUDIES["cpm3"].scales["tiny"].variants[0]
  assert mlp.base("tiny").model.mlp_type == "swiglu" and plain.base("tiny").model.mlp_type == "none"


@pytest.mark.full
def test_multikey_tiny_tests_at_longer_contexts(tmp_path, data_dir):
  out = str(tmp_path)
  variants = ["mha", "diff"]  # the reference and one other (every kind shares the path)
  run.main(_tiny_args("multikey_retrieval", out, data_dir, variants))
  data = _check_outputs(out, "multikey_retrieval", variants)
  assert data["transfer_bases"] == {"context_length": 24}
  for r in data["runs"].values():  # every trained model is tested at 2x its length too
    assert set(r["transfer"]) == {"context_length=48"}
    assert set(r["transfer"]["context_length=48"]) == {"loss", "token_accuracy", "exact_match"}
  with open(os.path.join(out, "multikey_retrieval.md")) as f:
    md = f.read()
  assert "Trained at `context_length` = 24" in md

  def mean_at(variant: str, key: str | None) -> float:
    runs = [
      r
      for r in data["runs"].values()
      if r["variant"] == variant
      and r["learning_rate"] == data["chosen_learning_rates"][variant]
      and r["sweep"] is None
    ]
    return np.mean([(r["transfer"][key] if key else r["test"])["token_accuracy"] for r in runs])

  # The relative row (the headline metric, accuracy per answer token) is diff's mean over
  # MHA's, minus 1, at each length.
  expected = [
    f"{100 * (mean_at('diff', k) / mean_at('mha', k) - 1):+.0f}%"
    for k in (None, "context_length=48")
  ]
  relative = md.split("Relative to global MHA (M)")[1]
  assert f"| differential (D) | {expected[0]} | {expected[1]} |" in relative


@pytest.mark.full
def test_polynomial_filter_tiny_regresses_the_powers(tmp_path, data_dir):
  out = str(tmp_path)
  variants = ["iha_k2"]  # the control: [X, AX] on 6 nodes (MHA's twin shares the path)
  run.main(_tiny_args("polynomial_filter", out, data_dir, variants))
  data = _check_outputs(out, "polynomial_filter", variants, control=("r_squared", 0.95))
  sweep = [r for r in data["runs"].values() if r["sweep"]]
  assert sorted((r["variant"], r["sweep"]["value"], r["seed"]) for r in sweep) == sorted(
    (v, 1, seed) for v in variants for seed in range(SEEDS)
  )
  with open(os.path.join(out, "polynomial_filter.md")) as f:
    header = "| variant | test normalised error 1 - R^2 % | test R^2 % | test accuracy % |"
    assert header in f.read()


def test_choose_rate_prefers_the_metric_then_the_lower_loss():
  runs = [
    {"learning_rate": lr, "validation": {"token_accuracy": acc, "loss": loss}}
    for lr, acc, loss in ((1e-3, 0.5, 1.0), (3e-3, 0.9, 0.4), (1e-2, 0.9, 0.3))
  ]
  assert protocol.choose_rate(runs, "token_accuracy") == 1e-2
  assert np.isclose(protocol.choose_rate(runs[:2], "token_accuracy"), 3e-3)


class _FakeVariant:
  """Stands in for a CompiledVariant: no training; validation best at rate 3e-2."""

  calls: list[tuple[float, int]] = []

  def __init__(self, config):
    self.config, self.params, self.attention_flops_per_token = config, 1, 1.0
    self.train_flops_per_step, self.num_pseudo = 6.0, config.model.num_pseudo

  def run(self, learning_rate, seed, **kwargs):
    self.calls.append((learning_rate, seed))
    score = -abs(learning_rate - 0.03)  # best at 3e-2: above the grid's top 1e-2
    metrics = {"token_accuracy": score, "exact_match": 0.0, "loss": 1.0}
    steps = kwargs["total_steps"]
    return RunResult(
      steps=steps, best_step=steps, validation=metrics, test=metrics, curve=[], wall_s=0.0
    )


def _fake_mqar(monkeypatch, num_variants: int):
  """mqar at tiny, without sweeps, its first `num_variants` variants, trained by fakes."""
  monkeypatch.setattr(protocol, "CompiledVariant", _FakeVariant)
  monkeypatch.setattr(protocol.inputs, "prepare", lambda config: None)
  monkeypatch.setattr(_FakeVariant, "calls", [])
  study = STUDIES["mqar"]
  scale = dataclasses.replace(study.scales["tiny"], sweeps=(), grid_extensions=2)
  return dataclasses.replace(study, variants=study.variants[:num_variants], scales={"tiny": scale})


def test_grid_extends_past_an_edge(monkeypatch, tmp_path):
  """A best rate on the grid's edge is followed one step further (same rule for all)."""
  study = _fake_mqar(monkeypatch, 1)
  data = protocol.run_study(study, "tiny", 2, str(tmp_path), str(tmp_path), progress=False)
  calls = _FakeVariant.calls
  assert [lr for lr, seed in calls if seed == 0] == [1e-3, 3e-3, 1e-2, 0.03, 0.1]
  assert data["chosen_learning_rates"]["iha"] == 0.03
  assert (0.03, 1) in calls
  # Every run's record names its P (the variant's config's).
  assert {r["num_pseudo"] for r in data["runs"].values()} == {
    study.scales["tiny"].config().model.num_pseudo
  }


def test_parts_run_apart_merge_into_the_whole(monkeypatch, tmp_path):
  """Variants run in separate directories, merged, equal the study run in one (order too)."""
  study = _fake_mqar(monkeypatch, 3)
  names = [v.name for v in study.variants]
  whole = protocol.run_study(study, "tiny", 2, str(tmp_path / "whole"), "", progress=False)
  parts = []
  for i, part in enumerate((names[2:], names[:2])):  # out of order on purpose
    parts.append(str(tmp_path / f"part{i}"))
    protocol.run_study(study, "tiny", 2, parts[-1], "", progress=False, variants=part)
  merged = protocol.merge_studies(study, "tiny", parts, str(tmp_path / "merged"))
  assert list(merged["runs"]) == list(whole["runs"])
  assert merged == whole
  with open(tmp_path / "part0" / "mqar.json") as f:
    conflicting = json.load(f)
  next(iter(conflicting["runs"].values()))["steps"] = 2
  with open(tmp_path / "part0" / "mqar.json", "w") as f:
    json.dump(conflicting, f)
  with pytest.raises(ValueError, match="runs .* differs"):
    protocol.merge_studies(study, "tiny", parts, str(tmp_path / "merged"))
  with pytest.raises(FileNotFoundError, match="every source must hold"):
    protocol.merge_studies(study, "tiny", [str(tmp_path)], str(tmp_path / "merged"))
  with pytest.raises(SystemExit):  # argparse: --merge takes no --variants
    run.main(["mqar", "--scale", "tiny", "--merge", parts[0], "--variants", "iha"])


def test_a_sweep_covers_its_variants_and_reuses_unchanged_runs(monkeypatch, tmp_path):
  """A sweep point runs only the variants it covers, trains each for its config's steps,
  and records the base run where the point leaves the config unchanged (no training)."""
  study = _fake_mqar(monkeypatch, 3)
  scale = study.scales["tiny"]
  first, second, _ = (v.name for v in study.variants)
  base_schedule = scale.config().model.attention_schedule  # the first variant's ("LM")

  def budget(config, point):  # the first variant keeps its steps, the second gets more
    if config.model.attention_schedule != base_schedule:
      config.train.total_steps += 7

  sweep = protocol.Sweep(
    "budget", "equal_steps", ("equal_flops",), budget, variants=(first, second)
  )
  study = dataclasses.replace(study, scales={"tiny": dataclasses.replace(scale, sweeps=(sweep,))})
  data = protocol.run_study(study, "tiny", 2, str(tmp_path), "", progress=False)
  point = {"axis": "budget", "value": "equal_flops"}
  swept = {(r["variant"], r["seed"]): r for r in data["runs"].values() if r["sweep"] == point}
  assert sorted(swept) == [(first, 0), (first, 1), (second, 0), (second, 1)]
  for seed in (0, 1):
    assert swept[first, seed]["same_as"] == f"{first}/lr=0.03/seed={seed}"
    assert swept[first, seed]["steps"] == scale.total_steps
    assert swept[second, seed]["steps"] == scale.total_steps + 7
    assert "same_as" not in swept[second, seed]
  # Trained: each variant's grid (five rates with the extensions) and seed 1, then only
  # the second variant's two seeds at the point.
  assert len(_FakeVariant.calls) == 3 * 6 + 2
  # Joined with a part from before the sweep existed, the merge keeps the sweep's axis.
  older = tmp_path / "older"
  older.mkdir()
  before = {k: v for k, v in data.items() if k not in ("sweep_bases", "runs")}
  (older / "mqar.json").write_text(json.dumps({**before, "sweep_bases": {}, "runs": {}}))
  merged = protocol.merge_studies(study, "tiny", [str(older), str(tmp_path)], str(tmp_path / "m"))
  assert merged["sweep_bases"] == {"budget": "equal_steps"} and merged["runs"] == data["runs"]


def test_quality_against_cost_places_each_variant_at_its_price(monkeypatch, tmp_path):
  """`experiments.quality_cost`: each variant's point sits at (its estimated step time /
  the reference's, its mean test metric), its error bar is the std over seeds, and the
  tables carry both budgets and the measured price apart from the estimate."""
  study = _fake_mqar(monkeypatch, 3)
  data = protocol.run_study(study, "tiny", 3, str(tmp_path), "", progress=False)
  names = [v.name for v in study.variants]
  # Distinct test values per seed, so means and stds are not trivially equal.
  for r in data["runs"].values():
    r["test"]["token_accuracy"] = 0.5 + 0.01 * names.index(r["variant"]) + 0.002 * r["seed"]
  study_path = tmp_path / "mqar.json"
  study_path.write_text(json.dumps(data))
  costs = {
    "reference": names[1],
    "estimated": {
      "what": "an estimate",
      "target": "v5p-8",
      "step_ms": {names[0]: 150.0, names[1]: 100.0},
      "cost_only": [{"label": "P = H", "step_ms": 240.0}],
    },
    "measured": {"what": "CPU", "command": "c", "ms_per_step": {names[0]: 30.0, names[1]: 20.0}},
  }
  (tmp_path / "costs.json").write_text(json.dumps(costs))
  monkeypatch.setattr(quality_cost, "STUDIES", {"mqar": study})
  md, png = quality_cost.main(
    ["--study", str(study_path), "--costs", str(tmp_path / "costs.json"), "--out", str(tmp_path)]
  )
  labels = {v.name: v.label for v in study.variants}
  table = open(md).read()
  assert f"| {labels[names[0]]} | " in table and "| 150.0 | 1.50 |" in table
  assert f"| {labels[names[2]]} | " in table and table.count("| - | - |") >= 1  # unpriced
  assert "| P = H | | (not trained) | | 240.0 | 2.40 |" in table
  assert f"| {labels[names[0]]} | 30 | 1.50 |" in table  # measured, its own table
  fig = quality_cost.plot(
    quality_cost.rows(data, costs, "token_accuracy"), costs, "token_accuracy", png
  )
  decode_png(png, dpi=110, figure=fig)
  seeds = 0.5 + 0.002 * np.arange(3)
  bars = {c.get_label(): c for c in fig.axes[0].containers}  # one errorbar per point
  for name, ratio in ((names[0], 1.5), (names[1], 1.0)):
    expected = seeds + 0.01 * names.index(name)
    x, y = bars[labels[name]].lines[0].get_xydata()[0]
    assert (x, y) == pytest.approx((ratio, expected.mean()))
    low, high = bars[labels[name]].lines[2][0].get_segments()[0]
    assert high[1] - low[1] == pytest.approx(2 * np.std(expected, ddof=1))
  assert labels[names[2]] not in bars  # no price: no point


def test_every_variant_of_the_lm_studies_builds_its_model(tmp_path):
  """Each `code_lm` and `multikey_retrieval` variant at every scale validates; PHA's two
  windows are IHA's "auto" window and twice it, in virtual tokens."""
  from iha_jax.train import config as config_lib

  for name in ("code_lm", "multikey_retrieval"):
    study = STUDIES[name]
    for scale in study.scales:
      for variant in study.contenders(scale):
        config = protocol.variant_config(study, scale, variant, str(tmp_path))
        config.model.vocab_size = 64
        model = config_lib.validate(config, 1)
        auto = config.data.seq_len // (2 * (config.model.num_pseudo or 1))
        if variant.name in ("pha", "pha_wide"):
          assert model.schedule[:4] == "RRRR" and model.num_pseudo == config.model.num_pseudo
          assert model.iha_window == auto * (2 if variant.name == "pha_wide" else 1)
        if variant.name == "iha_p8_h8":
          assert (model.num_heads, model.num_pseudo, model.head_dim * 8) == (8, 8, model.model_dim)
