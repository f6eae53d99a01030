"""Quality against cost: a study's test metric per variant beside each variant's price.

  python -m experiments.quality_cost --study docs/results/code_lm.json \
    --costs docs/results/code_lm_costs.json --out docs/results

Reads a study's runs (each variant's test metric at its chosen rate: mean, std and the
seeds, at equal steps and, where the study has the `budget` sweep, at equal training
FLOPs) and a cost file (below), and writes `OUT/STUDY_quality_cost.png`, one point per
variant: the test metric with its std as the error bar against the variant's estimated
TPU step time relative to the reference variant; and `OUT/STUDY_quality_cost.md`, the
tables behind it.

The cost file (JSON) keeps estimates and measurements apart, as the project prints them:
- `reference`: the variant the ratios divide by (e.g. "mha");
- `estimated`: `{"what", "target", "date", "step_ms": {variant: ms per chip},
  "commands": {variant: command}, "cost_only": [{"label", "step_ms", "command"}]}`: the
  step time per chip from libtpu's schedule of a compile-only program (an estimate, never
  a measurement); `cost_only` are priced settings the study has no quality point for
  (drawn as vertical lines);
- `measured`: `{"what", "command", "ms_per_step": {variant: ms}}`: step times measured
  side by side in one run (ratios are what to read).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from experiments import report
from experiments.studies import STUDIES
from experiments.variant_runs import LOWER_IS_BETTER

EQUAL_FLOPS = {"axis": "budget", "value": "equal_flops"}


def _stats(runs: list[dict[str, Any]], metric: str) -> tuple[float, float, list[float]] | None:
  """(mean, std over seeds, per-seed values) of the runs' test `metric`; None: no runs."""
  if not runs:
    return None
  values = [report.metric_value(r["test"], metric) for r in runs]
  std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  return float(np.mean(values)), std, values


def _format(stats: tuple[float, float, list[float]] | None) -> str:
  if stats is None:
    return "-"
  mean, std, values = stats
  if len(values) == 1:  # no spread to report
    return f"{mean:.3f} (one seed)"
  return f"{mean:.3f} ± {std:.3f} ({', '.join(f'{v:.3f}' for v in values)})"


def rows(data: dict[str, Any], costs: dict[str, Any], metric: str) -> list[dict[str, Any]]:
  """One row per variant (IHA by P, then the study's order): label, P, test `metric` at equal steps
  and at equal FLOPs (with the steps taken), estimated step ms and ratio to the reference,
  measured ms and ratio."""
  estimated, measured = costs["estimated"]["step_ms"], costs.get("measured", {})
  measured = measured.get("ms_per_step", {})
  reference = costs["reference"]
  out = []
  for variant in dict.fromkeys(r["variant"] for r in data["runs"].values()):
    base = report.chosen_runs(data, variant)
    if not base:
      continue
    flops_runs = report.chosen_runs(data, variant, EQUAL_FLOPS)
    row = {
      "variant": variant,
      "label": base[0]["label"],
      "num_pseudo": base[0].get("num_pseudo"),
      "equal_steps": _stats(base, metric),
      "equal_flops": _stats(flops_runs, metric),
      "flops_steps": sorted({r["steps"] for r in flops_runs}),
      "est_ms": estimated.get(variant),
      "est_ratio": None,
      "cpu_ms": measured.get(variant),
      "cpu_ratio": None,
    }
    if row["est_ms"] is not None and reference in estimated:
      row["est_ratio"] = row["est_ms"] / estimated[reference]
    if row["cpu_ms"] is not None and reference in measured:
      row["cpu_ratio"] = row["cpu_ms"] / measured[reference]
    out.append(row)
  # IHA by P first, then the others in the study's order.
  return sorted(out, key=lambda r: (r["num_pseudo"] is None, r["num_pseudo"] or 0))


def markdown(
  study_name: str, table: list[dict[str, Any]], costs: dict[str, Any], metric: str
) -> str:
  """The quality table (both budgets) with the estimated price, then the measured one."""
  name = report.METRIC_NAMES[metric]
  estimated = costs["estimated"]
  reference = next((r["label"] for r in table if r["variant"] == costs["reference"]), "")
  lines = [
    f"Test {name} (mean ± std over seeds, per-seed values) and each variant's price "
    f"({study_name}; estimated: {estimated['what']}):",
    "",
    f"| variant | P | at equal steps | at equal FLOPs (steps) | est. step ms per chip "
    f"({estimated['target']}) | est. / {reference} |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for row in table:
    steps = ", ".join(map(str, row["flops_steps"]))
    flops = _format(row["equal_flops"]) + (f" ({steps})" if steps else "")
    est = "-" if row["est_ms"] is None else f"{row['est_ms']:.1f}"
    ratio = "-" if row["est_ratio"] is None else f"{row['est_ratio']:.2f}"
    p = "-" if row["num_pseudo"] is None else str(row["num_pseudo"])
    lines.append(
      f"| {row['label']} | {p} | {_format(row['equal_steps'])} | {flops} | {est} | {ratio} |"
    )
  for extra in estimated.get("cost_only", []):
    ratio = extra["step_ms"] / estimated["step_ms"][costs["reference"]]
    lines.append(f"| {extra['label']} | | (not trained) | | {extra['step_ms']:.1f} | {ratio:.2f} |")
  measured = costs.get("measured")
  if measured:
    lines += [
      "",
      f"Measured: {measured['what']} (`{measured['command']}`):",
      "",
      f"| variant | ms per step | / {reference} |",
      "| --- | --- | --- |",
    ]
    lines += [
      f"| {row['label']} | {row['cpu_ms']:.0f} | {row['cpu_ratio']:.2f} |"
      for row in table
      if row["cpu_ratio"] is not None
    ]
  return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], costs: dict[str, Any], metric: str, path: str) -> Figure:
  """Test `metric` (mean ± std at equal steps) against the estimated step time relative
  to the reference, one labelled point per variant; written to `path` and returned."""
  fig = Figure(figsize=(6.4, 4.4), dpi=110)
  ax = fig.subplots()
  colors = matplotlib.colormaps["tab10"]
  for i, row in enumerate(r for r in table if r["est_ratio"] is not None):
    mean, std, _ = row["equal_steps"]
    ax.errorbar(
      row["est_ratio"], mean, yerr=std, marker="o", capsize=4, color=colors(i), label=row["label"]
    )
  estimated = costs["estimated"]
  for extra in estimated.get("cost_only", []):
    ratio = extra["step_ms"] / estimated["step_ms"][costs["reference"]]
    ax.axvline(ratio, color="grey", ls="--", lw=1)
    ax.annotate(
      extra["label"],
      (ratio, 0.5),
      xycoords=("data", "axes fraction"),
      rotation=90,
      xytext=(-10, 0),
      textcoords="offset points",
      fontsize=7,
      va="center",
      color="grey",
    )
  reference = next((r["label"] for r in table if r["variant"] == costs["reference"]), "")
  ax.set_xlabel(
    f"estimated step time / {reference} ({estimated['target']}, libtpu's schedule: an estimate)",
    fontsize=8,
  )
  ax.legend(fontsize=7)
  better = "lower" if metric in LOWER_IS_BETTER else "higher"
  ax.set_ylabel(f"test {report.METRIC_NAMES[metric]} ({better} is better)")
  ax.set_title(
    "quality against price, one point per variant (error bar: std over seeds)", fontsize=9
  )
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  return fig


def main(argv: list[str] | None = None) -> tuple[str, str]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--study", required=True, help="a study's JSON (experiments.run's)")
  parser.add_argument("--costs", required=True, help="the cost file (see the module docstring)")
  parser.add_argument("--out", required=True, help="output directory")
  args = parser.parse_args(argv)
  with open(args.study) as f:
    data = json.load(f)
  with open(args.costs) as f:
    costs = json.load(f)
  study = STUDIES[data["study"]]
  metric = study.metrics[0]
  table = rows(data, costs, metric)
  unpriced = [r["variant"] for r in table if r["est_ratio"] is None]
  if costs["reference"] not in costs["estimated"]["step_ms"]:
    parser.error(f"--costs: no estimated step_ms for the reference {costs['reference']!r}")
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"{study.name}_quality_cost")
  with open(stem + ".md", "w") as f:
    f.write(markdown(study.name, table, costs, metric))
  plot(table, costs, metric, stem + ".png")
  print(f"wrote {stem}.md, {stem}.png" + (f" (no price for {unpriced})" if unpriced else ""))
  return stem + ".md", stem + ".png"


if __name__ == "__main__":
  main()
