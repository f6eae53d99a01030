"""Long-context retrieval sweep: exact match of trained runs against context length.

Each run is evaluated on its own retrieval task (multi-key retrieval or MQAR, with the
training options) with only `length` changed, on `num_examples` test examples per
length. An overridden task gets its own dataset directory (the data package names it by
a digest of the options), prepared offline on first use. Lengths beyond the training
length measure RoPE extrapolation: accuracy is expected to fall there.
"""

from __future__ import annotations

from iha_jax.extras import require

require("train", "iha_jax.eval.sweep")

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import ml_collections

from iha_jax import storage
from iha_jax.checks import is_int
from iha_jax.eval.runs import EvalError, chance_exact_match, restore_run
from iha_jax.kinds import effective_num_pseudo

if TYPE_CHECKING:
  from matplotlib.figure import Figure

TASKS = ("multikey_retrieval", "mqar")  # tasks with a `length` option and exact match
TASK_TITLES = {
  "multikey_retrieval": "Multi-key retrieval",
  "mqar": "Multi-query associative recall",
}
JSON_NAME, PNG_NAME = "length_sweep.json", "length_sweep.png"


def parse_lengths(values: Sequence[str | int]) -> list[int]:
  """`["128", "256"]` -> `[128, 256]` (sorted, distinct); raises ValueError naming
  `--sweep_lengths` when empty or not positive integers."""
  if not values:
    raise EvalError("--sweep_lengths must list at least one context length, e.g. 128,256")
  try:
    lengths = sorted({int(v) for v in values})
  except ValueError:
    raise EvalError(f"--sweep_lengths must be integers, got {list(values)}") from None
  if lengths[0] < 1:
    raise EvalError(f"--sweep_lengths must be positive, got {list(values)}")
  return lengths


def task_config(
  config: ml_collections.ConfigDict, length: int, num_examples: int
) -> ml_collections.ConfigDict:
  """A copy of a run's config whose data is its retrieval task at `length` tokens, with
  `num_examples` test examples (and one of each other split: not read, but generated)."""
  config = ml_collections.ConfigDict(config.to_dict())
  options = dict(config.data.options or {})
  options.update(length=length, num_train=1, num_validation=1, num_test=num_examples)
  config.data.options = options
  config.data.seq_len = length
  return config


def run_label(name: str, config: ml_collections.ConfigDict) -> str:
  """`"iha (IM, P=2)"`: the run's name, attention schedule and P (IHA layers only)."""
  schedule = config.model.attention_schedule
  if not set(schedule) & {"I", "L"}:
    return f"{name} ({schedule})"
  p = effective_num_pseudo(config.model.num_pseudo, config.model.num_heads)
  return f"{name} ({schedule}, P={p})"


def length_sweep(
  workdirs: Sequence[str],
  lengths: Sequence[int],
  out_dir: str,
  *,
  num_examples: int = 128,
  split: str = "test",
  step: int | None = None,
  mesh: dict[str, int] | None = None,
) -> dict[str, Any]:
  """Evaluates every run at every length; writes `out_dir/length_sweep.{json,png}`.

  Returns:
    `{"lengths", "examples", "split", "runs": {name: {"workdir", "label", "dataset",
    "step", "train_length", "chance_exact_match", "exact_match": {length: accuracy},
    "token_accuracy": {length: accuracy}}}}`; JSON keys of lengths are strings. `out_dir`
    may be local or remote (`gs://...`).
  """
  if not workdirs:
    raise EvalError("--workdir: give at least one run directory to sweep")
  lengths = parse_lengths(lengths)
  if not is_int(num_examples, 1):
    raise EvalError(f"--sweep_examples must be a positive integer, got {num_examples!r}")
  runs: dict[str, Any] = {}
  for workdir in workdirs:
    run = restore_run(workdir, step, mesh)
    if not run.config.data.name.startswith(TASKS):
      raise EvalError(
        f"--sweep_lengths needs runs trained on one of {TASKS}; "
        f"--workdir {workdir!r} trained on {run.config.data.name!r}"
      )
    # Distinct names even for runs whose directories share a basename.
    name = run.name if run.name not in runs else run.workdir
    record = {
      "workdir": run.workdir,
      "label": run_label(name, run.config),
      "dataset": run.config.data.name,
      "step": run.step,
      "train_length": run.config.data.seq_len,
      "chance_exact_match": chance_exact_match(run.config),
      "exact_match": {},
      "token_accuracy": {},
    }
    for length in lengths:
      metrics = run.evaluate(task_config(run.config, length, num_examples), split)
      record["exact_match"][str(length)] = metrics["exact_match"]
      record["token_accuracy"][str(length)] = metrics["token_accuracy"]
      logging.info("sweep %s length %d: %s", name, length, metrics)
    runs[name] = record
  result = {"lengths": lengths, "examples": num_examples, "split": split, "runs": runs}
  if jax.process_index() == 0:
    storage.write_text(storage.join(out_dir, JSON_NAME), json.dumps(result, indent=2))
    plot_sweep(result, sweep_png(out_dir))
  return result


def sweep_png(out_dir: str) -> str:
  """The path of the sweep's plot in `out_dir`."""
  return storage.join(out_dir, PNG_NAME)


def sweep_title(result: dict[str, Any]) -> str:
  """`"Multi-query associative recall (mqar/cpu_demo) against context length"`: the
  task and dataset(s) the runs were trained on."""
  datasets = sorted({record.get("dataset", "") for record in result["runs"].values()} - {""})
  tasks = sorted({TASK_TITLES.get(name.split("/")[0], name) for name in datasets})
  if not tasks:
    return "Exact match against context length"
  return f"{' / '.join(tasks)} ({', '.join(datasets)}) against context length"


def plot_sweep(result: dict[str, Any], path: str) -> Figure:
  """Exact match against context length (log2 axis), one line per run, the training
  lengths dotted and chance dashed; written to `path` (local or remote) and returned."""
  # The Figure API renders with Agg without touching pyplot's global backend.
  require("plots", "sweep_png")
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(6.4, 4.2), layout="constrained")
  ax = fig.subplots()
  lengths = result["lengths"]
  for index, record in enumerate(result["runs"].values()):
    color = f"C{index}"
    ax.plot(
      lengths,
      [record["exact_match"][str(n)] for n in lengths],
      marker="o",
      color=color,
      label=record["label"],
    )
    ax.axvline(record["train_length"], color=color, linestyle=":", linewidth=1)
  chances = {r["chance_exact_match"] for r in result["runs"].values()} - {None}
  if len(chances) == 1:
    ax.axhline(chances.pop(), color="gray", linestyle="--", linewidth=1, label="chance")
  ax.set_xscale("log", base=2)
  ax.set_xticks(lengths, [str(n) for n in lengths])
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("context length (tokens); dotted: training length")
  ax.set_ylabel(f"exact match ({result['examples']} {result['split']} examples)")
  ax.set_title(sweep_title(result), fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend()
  with storage.as_path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=120)
  return fig
