"""The comparison protocol every published study follows (docs/design.md §7).

For every variant: train over the variant's own learning-rate grid (seed 0; extended by
up to two steps past an edge where the best rate sits), choose the rate on validation,
train the remaining seeds at that rate, evaluate every run on test. Only when every
variant has its chosen rate and seeds: at each variant's chosen rate and for every seed,
the study's sweep points (e.g. more key-value pairs, another width, equal training FLOPs;
a point that leaves a variant's config unchanged records its base runs). Every finished run
is written to `DIR/STUDY.json` at once, so a rerun skips it (resumable); the report is
rewritten at the end. Parts of one study run apart (e.g. `--variants` split over
processes or hosts) are joined by `merge_studies`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import tqdm
from etils import epath

from experiments.variant_runs import CompiledVariant, selection_score
from iha_jax import data as data_lib
from iha_jax.data import registry, text_stats
from iha_jax.train import inputs

ConfigEdit = Callable[[ml_collections.ConfigDict], None]


@dataclasses.dataclass(frozen=True)
class Variant:
  """One contender: a name, a label for tables, and edits of the base config.

  `base(scale_name)`, when given, replaces the scale's base config (e.g. another
  rendering of the task); `edit` applies after it.
  """

  name: str
  label: str
  edit: ConfigEdit
  base: Callable[[str], ml_collections.ConfigDict] | None = None


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Extra points of one axis, run at each variant's chosen rate for every seed; the
  base runs are the point `base` of the axis. With `retune`, each point gets its own
  rate: the scale's grid on seed 0 at that point, best on validation (for axes that
  change what a good rate is, e.g. the number of heads, and with it IHA's P = H)."""

  axis: str  # e.g. "num_pairs"
  base: Any  # the axis value of the base config
  values: tuple[Any, ...]  # the other points
  edit: Callable[[ml_collections.ConfigDict, Any], None]
  retune: bool = False
  # The variants this sweep covers (names); empty: every contender.
  variants: tuple[str, ...] = ()

  def covers(self, variant: str) -> bool:
    return not self.variants or variant in self.variants


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Test sets every trained model is also evaluated on, without training (e.g. longer
  contexts): its best parameters on the test split of the config edited to each value.
  The run's own test set is the point `base` of the axis."""

  axis: str  # e.g. "context_length"
  base: Any  # the axis value of the training config
  values: tuple[Any, ...]  # the other points
  edit: Callable[[ml_collections.ConfigDict, Any], None]


@dataclasses.dataclass(frozen=True)
class Scale:
  """Budget of a study at one scale."""

  config: Callable[[], ml_collections.ConfigDict]  # the base config (every key)
  learning_rates: tuple[float, ...]  # every variant's grid
  total_steps: int
  eval_every: int
  patience: int  # validation passes without improvement
  sweeps: tuple[Sweep, ...] = ()
  # A variant whose best grid rate is the grid's largest (smallest) gets the next rate up
  # (down) of the 1-3-10 series, up to this many times, so no variant is judged at the
  # edge of a grid too narrow for it. Every variant follows the same rule.
  grid_extensions: int = 2
  # This scale's own contenders (e.g. one pair per sequence length); empty: the study's.
  variants: tuple[Variant, ...] = ()
  transfers: tuple[Transfer, ...] = ()


@dataclasses.dataclass(frozen=True)
class Study:
  """A comparison: variants, scales, the selection metric and the paper's numbers."""

  name: str
  title: str
  description: str
  variants: tuple[Variant, ...]
  scales: dict[str, Scale]
  # Validation metric that picks the rate: higher wins, except the loss and bits per byte.
  select: str
  metrics: tuple[str, ...]  # test metrics reported, the first one plotted
  paper: str  # what the paper reports, verbatim, for the page
  # The variant others are compared with in relative terms (transfer tables), if any.
  reference: str | None = None
  # Called with every variant's config and the scale's name before the variant is
  # compiled (data_dir set): prepares what the data needs beyond the dataset (e.g. a
  # tokenizer trained on the train split) and may edit `config.data` accordingly.
  prepare: Callable[[ml_collections.ConfigDict, str], None] | None = None
  # The x axes of the learning curves: "step", "tokens", "train_flops".
  curves_against: tuple[str, ...] = ("step",)

  def contenders(self, scale_name: str) -> tuple[Variant, ...]:
    """The variants compared at `scale_name`: the scale's own, else the study's."""
    return self.scales[scale_name].variants or self.variants


def half_decade_step(rate: float, up: bool) -> float:
  """The next rate of the 1-3-10 series above (or below) `rate`: 1e-2 -> 3e-2 -> 1e-1."""
  series = sorted(m * 10.0**e for e in range(-8, 3) for m in (1, 3))
  if up:
    return float(f"{next(r for r in series if r > rate * 1.01):.3g}")
  return float(f"{next(r for r in reversed(series) if r < rate / 1.01):.3g}")


def run_key(variant: str, learning_rate: float, seed: int, sweep: tuple[str, Any] | None) -> str:
  key = f"{variant}/lr={learning_rate:g}/seed={seed}"
  return key if sweep is None else f"{key}/{sweep[0]}={sweep[1]}"


def variant_config(
  study: Study,
  scale_name: str,
  variant: Variant,
  data_dir: str,
  sweep: tuple[Sweep, Any] | None = None,
) -> ml_collections.ConfigDict:
  """The full training config of `variant` (and a sweep point) at `scale_name`."""
  scale = study.scales[scale_name]
  config = scale.config() if variant.base is None else variant.base(scale_name)
  config.data.data_dir = data_dir
  config.train.total_steps = scale.total_steps
  variant.edit(config)
  if sweep is not None:
    sweep[0].edit(config, sweep[1])
  return config


def same_config(study: Study, scale_name: str, variant: Variant, sweep: tuple[Sweep, Any]) -> bool:
  """Whether the sweep point leaves `variant`'s config unchanged (its base run stands)."""
  base = variant_config(study, scale_name, variant, "")
  return base.to_dict() == variant_config(study, scale_name, variant, "", sweep).to_dict()


def _point(sweep: tuple[Sweep, Any]) -> dict[str, Any]:
  return {"axis": sweep[0].axis, "value": sweep[1]}


def choose_rate(runs: Sequence[dict[str, Any]], select: str) -> float:
  """The grid rate with the best validation `select` (ties: lower validation loss)."""
  best = max(runs, key=lambda r: selection_score(r["validation"], select))
  return best["learning_rate"]


class Store:
  """`DIR/STUDY.json`: the finished runs, rewritten after each one (resumable)."""

  def __init__(self, path: str, header: dict[str, Any]):
    self.path = path
    self.data = {**header, "runs": {}, "chosen_learning_rates": {}}
    if os.path.exists(path):
      with open(path) as f:
        saved = json.load(f)
      if {k: saved.get(k) for k in header} != header:
        found = {k: saved.get(k) for k in header}
        raise ValueError(
          f"{path} holds another study or scale ({found}); use another --out or delete it"
        )
      self.data = saved

  def __contains__(self, key: str) -> bool:
    return key in self.data["runs"]

  def add(self, key: str, record: dict[str, Any]) -> None:
    self.data["runs"][key] = record
    self.save()

  def save(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(tmp, self.path)  # atomic: a killed run never leaves a torn file


def describe_text_data(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """What a text corpus run read: the dataset's metadata (e.g. `python_stdlib`'s Python
  version and file digest), its options, the tokenizer file's sha256 and the validation
  split's bytes per scored token."""
  builder = registry.get_builder(config.data.name, config.data.data_dir, dict(config.data.options))
  tokenizer = config.data.tokenizer
  digest = "builtin"
  if tokenizer not in data_lib.BUILTIN_TOKENIZERS:
    digest = hashlib.sha256(epath.Path(tokenizer).read_bytes()).hexdigest()
  metadata = {k: v for k, v in dict(builder.info.metadata or {}).items() if k != "skipped_files"}
  return {
    **metadata,
    "config": builder.builder_config.name if builder.builder_config else None,
    "options": dict(config.data.options),
    "tokenizer": os.path.basename(tokenizer),
    "tokenizer_sha256": digest,
    "vocab_size": data_lib.vocab_size(config.data),
    "validation_bytes_per_token": text_stats.scored_text(config.data, "validation").bytes_per_token,
  }


def sweep_rate_key(variant: str, axis: str, value: Any) -> str:
  """Key of a re-tuned sweep point's rate in the study JSON's `sweep_rates`."""
  return f"{variant}/{axis}={value}"


def planned_runs(scale: Scale, seeds: int, variants: Sequence[str]) -> int:
  """Runs of `variants` without grid extensions (the progress bar's total grows by those)."""
  total = 0
  for name in variants:
    sweeps = [s for s in scale.sweeps if s.covers(name)]
    total += len(scale.learning_rates) + (seeds - 1)
    total += seeds * sum(len(s.values) for s in sweeps)
    total += (len(scale.learning_rates) - 1) * sum(len(s.values) for s in sweeps if s.retune)
  return total


def run_study(
  study: Study,
  scale_name: str,
  seeds: int,
  out: str,
  data_dir: str,
  progress: bool = True,
  variants: Sequence[str] | None = None,
) -> dict[str, Any]:
  """Runs (or resumes) `study` at `scale_name`; returns the store's data.

  `variants` (names) restricts the run to some variants (default: all).
  """
  if seeds < 1:
    raise ValueError(f"--seeds must be >= 1, got {seeds}")
  scale = study.scales[scale_name]
  contenders = study.contenders(scale_name)
  names = [v.name for v in contenders]
  unknown = sorted(set(variants or ()) - set(names))
  if unknown:
    raise ValueError(
      f"{study.name} has no variant(s) {unknown} at scale {scale_name}; choose from {names}"
    )
  chosen_variants = [v for v in contenders if variants is None or v.name in variants]
  os.makedirs(out, exist_ok=True)
  store = Store(
    os.path.join(out, f"{study.name}.json"),
    {"study": study.name, "scale": scale_name, "select": study.select},
  )
  store.data["seeds"] = seeds
  store.data["sweep_bases"] = {s.axis: s.base for s in scale.sweeps}
  store.data["transfer_bases"] = {t.axis: t.base for t in scale.transfers}
  runs_bar = tqdm.tqdm(
    total=planned_runs(scale, seeds, [v.name for v in chosen_variants]),
    desc=f"{study.name} runs",
    position=0,
    disable=not progress,
  )
  runs_bar.update(
    sum(r["variant"] in {v.name for v in chosen_variants} for r in store.data["runs"].values())
  )
  prepared: set[str] = set()
  compiled: dict[tuple[str, Any], CompiledVariant] = {}

  def prepare(config: ml_collections.ConfigDict) -> None:
    name = config.data.name + repr(dict(config.data.options))
    if name not in prepared:
      inputs.prepare(config)
      prepared.add(name)
      if data_lib.is_text(config.data.name):  # the result names its data
        store.data.setdefault("data", {})[config.data.name] = describe_text_data(config)
        store.save()

  def run(
    variant: Variant,
    learning_rate: float,
    seed: int,
    phase: str,
    sweep: tuple[Sweep, Any] | None = None,
  ) -> dict[str, Any]:
    point = None if sweep is None else (sweep[0].axis, sweep[1])
    key = run_key(variant.name, learning_rate, seed, point)
    if key in store:
      return store.data["runs"][key]
    base_key = run_key(variant.name, learning_rate, seed, None)
    if sweep is not None and base_key in store and same_config(study, scale_name, variant, sweep):
      # The point leaves this variant's config as it is (e.g. the variant that sets an
      # equal-FLOPs budget): its run is the base run, recorded at the point too.
      record = {**store.data["runs"][base_key], "phase": phase, "sweep": _point(sweep)}
      store.add(key, {**record, "same_as": base_key})
      runs_bar.update(1)
      return record
    if (variant.name, point) not in compiled:
      config = variant_config(study, scale_name, variant, data_dir, sweep)
      if study.prepare is not None:
        study.prepare(config, scale_name)
      prepare(config)
      compiled.clear()  # one variant's compiled functions at a time
      compiled[variant.name, point] = CompiledVariant(config)
    target = compiled[variant.name, point]
    transfer_tests = {}
    for transfer in scale.transfers:
      for value in transfer.values:
        test_config = ml_collections.ConfigDict(target.config.to_dict())
        transfer.edit(test_config, value)
        prepare(test_config)
        transfer_tests[f"{transfer.axis}={value}"] = test_config
    total_steps = target.config.train.total_steps  # the scale's, unless a sweep point's
    steps_bar = tqdm.tqdm(
      total=total_steps, desc=key, position=1, leave=False, disable=not progress
    )
    result = target.run(
      learning_rate,
      seed,
      total_steps=total_steps,
      eval_every=scale.eval_every,
      patience=scale.patience,
      select=study.select,
      on_step=lambda _: steps_bar.update(1),
      transfer_tests=transfer_tests,
    )
    steps_bar.close()
    record = {
      "variant": variant.name,
      "label": variant.label,
      "phase": phase,
      "learning_rate": learning_rate,
      "seed": seed,
      "sweep": None if sweep is None else _point(sweep),
      "num_pseudo": target.num_pseudo,
      "params": target.params,
      "attention_flops_per_token": target.attention_flops_per_token,
      "train_flops_per_step": target.train_flops_per_step,
      "batch_size": target.config.train.batch_size,
      "seq_len": target.config.data.seq_len,
      **dataclasses.asdict(result),
    }
    store.add(key, record)
    runs_bar.update(1)
    return record

  # Pass 1, the comparison itself: every variant's grid and seeds. Sweeps come after, so
  # a study stopped part-way still compares every variant at its chosen rate.
  for variant in chosen_variants:
    grid = [run(variant, lr, 0, "grid") for lr in scale.learning_rates]
    chosen = choose_rate(grid, study.select)
    for _ in range(scale.grid_extensions):  # the best rate on an edge: one step further
      rates = sorted(r["learning_rate"] for r in grid)
      if chosen not in (rates[0], rates[-1]) or len(rates) < 2:
        break
      runs_bar.total += 1
      grid.append(run(variant, half_decade_step(chosen, up=chosen == rates[-1]), 0, "grid"))
      if choose_rate(grid, study.select) == chosen:
        break
      chosen = choose_rate(grid, study.select)
    store.data["chosen_learning_rates"][variant.name] = chosen
    store.save()
    for seed in range(1, seeds):
      run(variant, chosen, seed, "seed")
  # Pass 2: the sweep points, at each variant's chosen rate (or the point's own, re-tuned
  # on seed 0), every seed.
  for sweep in scale.sweeps:
    for value in sweep.values:
      for variant in (v for v in chosen_variants if sweep.covers(v.name)):
        chosen = store.data["chosen_learning_rates"][variant.name]
        if sweep.retune:
          point = (sweep, value)
          grid = [run(variant, lr, 0, "sweep_grid", point) for lr in scale.learning_rates]
          chosen = choose_rate(grid, study.select)
          store.data.setdefault("sweep_rates", {})[
            sweep_rate_key(variant.name, sweep.axis, value)
          ] = chosen
          store.save()
        for seed in range(seeds):
          run(variant, chosen, seed, "sweep", (sweep, value))
  runs_bar.close()
  return store.data


def merge_studies(
  study: Study, scale_name: str, sources: Sequence[str], out: str
) -> dict[str, Any]:
  """Joins the `STUDY.json` files in the directories `sources` into `out/STUDY.json`
  (created or extended) and returns its data; trains nothing.

  Runs are ordered by the study's variants (so tables read the same however the work was
  split); a run or chosen rate found twice must agree, else ValueError names the key.
  """
  header = {"study": study.name, "scale": scale_name, "select": study.select}
  os.makedirs(out, exist_ok=True)
  target = Store(os.path.join(out, f"{study.name}.json"), header)
  parts = [target.data]
  for source in sources:
    path = os.path.join(source, f"{study.name}.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"--merge: no {path}; every source must hold {study.name}.json")
    parts.append(Store(path, header).data)  # Store checks study, scale and selection
  merged: dict[str, dict[str, Any]] = {"runs": {}, "chosen_learning_rates": {}, "sweep_rates": {}}
  for part in parts:
    for field, entries in merged.items():
      for key, value in part.get(field, {}).items():
        if key in entries and entries[key] != value:
          raise ValueError(f"--merge: {field} {key!r} differs between the sources")
        entries[key] = value
  order = {v.name: i for i, v in enumerate(study.contenders(scale_name))}
  runs = sorted(merged["runs"].items(), key=lambda kv: order.get(kv[1]["variant"], len(order)))
  target.data.update(
    runs=dict(runs),  # sorted() is stable: each variant's runs keep their order
    chosen_learning_rates=merged["chosen_learning_rates"],
    seeds=max(part.get("seeds", 0) for part in parts),
  )
  for field in ("sweep_bases", "transfer_bases"):  # every part's axes (a part may predate one)
    bases: dict[str, Any] = {}
    for part in parts:
      for axis, base in part.get(field, {}).items():
        if bases.setdefault(axis, base) != base:
          raise ValueError(f"--merge: {field} {axis!r} differs between the sources")
    target.data[field] = bases
  datasets = {name: d for part in parts for name, d in part.get("data", {}).items()}
  if datasets:
    target.data["data"] = datasets
  if merged["sweep_rates"]:
    target.data["sweep_rates"] = merged["sweep_rates"]
  target.save()
  return target.data
