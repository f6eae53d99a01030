"""A study's results as `STUDY.md` (tables: mean +- std with per-seed values, budgets,
the learning-rate grid, the paper's numbers) and `STUDY.png` (bars with error bars,
learning curves, sweeps), written from `STUDY.json` alone."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure  # the object API: files only, no pyplot state

from experiments.protocol import Study, sweep_rate_key

METRIC_NAMES = {
  "token_accuracy": "accuracy",
  "exact_match": "exact match",
  "loss": "loss",
  "r_squared": "R^2",
  "normalized_error": "normalised error 1 - R^2",
  "bits_per_byte": "bits per byte",
}
# Metrics the report derives from recorded ones (lower is better for these).
_DERIVED = {"normalized_error": lambda m: 1.0 - m["r_squared"]}
# Metrics shown as they are (nats per token, bits per byte); the others in percent.
_ABSOLUTE = frozenset({"loss", "bits_per_byte"})
# Learning-curve x axes: label and the value of a curve point of a run.
CURVE_AXES = {
  "step": ("training step", lambda run, point: point["step"]),
  "tokens": (
    "training tokens (batch x seq_len per step)",
    lambda run, point: point["step"] * run["batch_size"] * run["seq_len"],
  ),
  "train_flops": (
    "training FLOPs (whole model, forward + backward)",
    lambda run, point: point["step"] * run["train_flops_per_step"],
  ),
}


def metric_value(metrics: dict[str, float], name: str) -> float:
  """`metrics[name]`, or the value derived from them (`normalized_error`)."""
  return _DERIVED[name](metrics) if name in _DERIVED else metrics[name]


def chosen_runs(
  data: dict[str, Any], variant: str, sweep: dict | None = None
) -> list[dict[str, Any]]:
  """Runs of `variant` at its chosen rate (all seeds), at a sweep point or the base (a
  sweep point at the axis's base value is the base)."""
  rate = data["chosen_learning_rates"].get(variant)
  if sweep is not None and data.get("sweep_bases", {}).get(sweep["axis"]) == sweep["value"]:
    sweep = None
  if sweep is not None:  # a re-tuned point has its own rate
    key = sweep_rate_key(variant, sweep["axis"], sweep["value"])
    rate = data.get("sweep_rates", {}).get(key, rate)
  return sorted(
    (
      r
      for r in data["runs"].values()
      if r["variant"] == variant and r["learning_rate"] == rate and r["sweep"] == sweep
    ),
    key=lambda r: r["seed"],
  )


def _transfer_runs(
  data: dict[str, Any], variant: str, axis: str, value: Any
) -> list[dict[str, Any]]:
  """`{"test": metrics}` of `variant`'s chosen-rate base runs on the transfer test set
  `axis=value` (the base value: the runs' own test set)."""
  runs = chosen_runs(data, variant)
  if data["transfer_bases"][axis] == value:
    return runs
  key = f"{axis}={value}"
  return [{"test": r["transfer"][key]} for r in runs if key in r.get("transfer", {})]


def _transfer_points(study: Study, data: dict[str, Any]) -> dict[str, list[Any]]:
  """Transfer axis -> its points (base included), sorted."""
  scale = study.scales[data["scale"]]
  return {t.axis: sorted({t.base, *t.values}) for t in scale.transfers}


def scale_of(metric: str) -> float:
  """The factor a metric is shown with: 100 (percent), or 1 for losses and bits."""
  return 1.0 if metric in _ABSOLUTE else 100.0


def metric_label(metric: str, prefix: str) -> str:
  """E.g. "test accuracy %" or "validation loss"."""
  unit = "" if metric in _ABSOLUTE else " %"
  return f"{prefix} {METRIC_NAMES[metric]}{unit}"


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
  return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _cell(runs: Sequence[dict[str, Any]], metric: str, split: str = "test") -> str:
  """`mean +- std (v1, v2, ...)` in percent (loss and bits per byte as they are)."""
  if not runs:
    return "-"
  values = [metric_value(r[split], metric) * scale_of(metric) for r in runs]
  mean, std = _mean_std(values)
  # Errors near 0 keep three significant digits; percentages one decimal.
  fmt = {"loss": "{:.3f}", "bits_per_byte": "{:.3f}", "normalized_error": "{:.3g}"}.get(
    metric, "{:.1f}"
  )
  seeds = ", ".join(fmt.format(v) for v in values)
  return f"{fmt.format(mean)} ± {fmt.format(std)} ({seeds})"


def _si(value: float) -> str:
  for suffix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if value >= scale:
      return f"{value / scale:.3g}{suffix}"
  return f"{value:.3g}"


def _variant_table(
  caption: str, columns: Sequence[Any], rows: Sequence[tuple[str, Sequence[str]]]
) -> list[str]:
  """Markdown lines: a blank line, `caption`, then a table of one row per `(label,
  cells)` under the header `variant | columns...`."""
  lines = ["", caption, "", "| variant | " + " | ".join(str(c) for c in columns) + " |"]
  lines.append("|" + " --- |" * (len(columns) + 1))
  return lines + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]


def markdown(study: Study, data: dict[str, Any]) -> str:
  """The study's page section: results, grid, budgets, sweeps, the paper's numbers."""
  metrics = study.metrics
  head = ["variant", *(metric_label(m, "test") for m in metrics)]
  lines = [
    f"## {study.title} (`{study.name}`, scale `{data['scale']}`)",
    "",
    study.description,
    "",
    f"Regenerate: `python -m experiments.run {study.name} --scale {data['scale']} "
    f"--seeds {data['seeds']}`. Test metrics are mean ± std over "
    f"{data['seeds']} seeds (per-seed values in brackets) at each variant's own "
    f"learning rate, chosen on validation {METRIC_NAMES[study.select]}.",
  ]
  for name, described in data.get("data", {}).items():
    lines += ["", f"Data `{name}`: " + ", ".join(f"{k} {v}" for k, v in described.items())]
  lines += ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  variants = list(dict.fromkeys(r["variant"] for r in data["runs"].values()))
  labels = {r["variant"]: r["label"] for r in data["runs"].values()}
  for v in variants:
    runs = chosen_runs(data, v)
    lines.append("| " + " | ".join([labels[v], *(_cell(runs, m) for m in metrics)]) + " |")

  rates = sorted({r["learning_rate"] for r in data["runs"].values() if r["phase"] == "grid"})
  lines += [
    "",
    f"Learning-rate grid ({metric_label(study.select, 'validation')}, seed 0; **bold** = chosen):",
    "",
    "| variant | " + " | ".join(f"{lr:g}" for lr in rates) + " |",
    "|" + " --- |" * (len(rates) + 1),
  ]
  for v in variants:
    row = []
    for lr in rates:
      run = next(
        (
          r
          for r in data["runs"].values()
          if r["variant"] == v and r["phase"] == "grid" and r["learning_rate"] == lr
        ),
        None,
      )
      fmt = "{:.3f}" if study.select in _ABSOLUTE else "{:.1f}"
      value = None if run is None else run["validation"][study.select]
      text = "-" if value is None else fmt.format(scale_of(study.select) * value)
      chosen = data["chosen_learning_rates"].get(v) == lr
      row.append(f"**{text}**" if chosen and run is not None else text)
    lines.append(f"| {labels[v]} | " + " | ".join(row) + " |")

  lines += [
    "",
    "Budgets (per run at the chosen rate): parameters, forward attention FLOPs "
    "per token (all layers), steps taken (early stopping), training tokens and training "
    "FLOPs (whole model, forward + backward, mean over the seeds):",
    "",
    "| variant | parameters | attention FLOPs/token | steps (best step) | train tokens "
    "| train FLOPs | wall s |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for v in variants:
    runs = chosen_runs(data, v)
    if not runs:
      continue
    r0 = runs[0]
    steps = ", ".join(f"{r['steps']} ({r['best_step']})" for r in runs)
    tokens = np.mean([r["steps"] * r["batch_size"] * r["seq_len"] for r in runs])
    wall = np.mean([r["wall_s"] for r in runs])
    # Runs recorded before the field existed show "-".
    per_step = [r.get("train_flops_per_step") for r in runs]
    train_flops = (
      "-" if None in per_step else _si(np.mean([r["steps"] * f for r, f in zip(runs, per_step)]))
    )
    lines.append(
      f"| {labels[v]} | {r0['params']:,} | {_si(r0['attention_flops_per_token'])} | "
      f"{steps} | {_si(tokens)} | {train_flops} | {wall:.0f} |"
    )

  sweeps = {}
  for r in data["runs"].values():
    if r["sweep"] is not None:
      sweeps.setdefault(r["sweep"]["axis"], {data["sweep_bases"][r["sweep"]["axis"]]}).add(
        r["sweep"]["value"]
      )
  for axis, values in sweeps.items():
    values = sorted(values)
    metric = metrics[0]
    lines += _variant_table(
      f"Sweep over `{axis}` ({metric_label(metric, 'test')}, each variant at its "
      f"chosen rate or the point's re-tuned one, same seeds; "
      f"{data['sweep_bases'][axis]} is the base point above):",
      values,
      [
        (
          labels[v],
          [_cell(chosen_runs(data, v, {"axis": axis, "value": x}), metric) for x in values],
        )
        for v in variants
      ],
    )
    rates = data.get("sweep_rates", {})
    if any(sweep_rate_key(v, axis, x) in rates for v in variants for x in values):
      chosen = data["chosen_learning_rates"]  # the base point's rate
      lines += _variant_table(
        f"Rates re-tuned at each `{axis}` point (validation {METRIC_NAMES[study.select]}, "
        "seed 0; the base point's is the chosen rate above):",
        values,
        [
          (labels[v], [f"{rates.get(sweep_rate_key(v, axis, x), chosen[v]):g}" for x in values])
          for v in variants
        ],
      )

  for axis, points in _transfer_points(study, data).items():
    metric = metrics[0]
    means = {  # variant -> mean test metric per point (None: no runs)
      v: [
        np.mean([metric_value(r["test"], metric) for r in runs]) if runs else None
        for runs in (_transfer_runs(data, v, axis, x) for x in points)
      ]
      for v in variants
    }
    lines += _variant_table(
      f"Trained at `{axis}` = {data['transfer_bases'][axis]}, tested at every `{axis}` "
      f"({metric_label(metric, 'test')}, the runs above, no further training):",
      points,
      [
        (labels[v], [_cell(_transfer_runs(data, v, axis, x), metric) for x in points])
        for v in variants
      ],
    )
    reference = study.reference
    if reference in variants:
      lines += _variant_table(
        f"Relative to {labels[reference]} (ratio of the means minus 1, as the paper reports it):",
        points,
        [
          (
            labels[v],
            [
              "-" if ours is None or not theirs else f"{100 * (ours / theirs - 1):+.0f}%"
              for ours, theirs in zip(means[v], means[reference])
            ],
          )
          for v in variants
          if v != reference
        ],
      )

  lines += ["", f"The paper: {study.paper}", ""]
  return "\n".join(lines)


def plot(study: Study, data: dict[str, Any], path: str) -> Figure:
  """Bars (test metric, mean ± std, seeds as dots), validation learning curves at the
  chosen rates, one panel per sweep axis and one per transfer axis; written to `path`
  and returned."""
  metric = study.metrics[0]
  variants = list(dict.fromkeys(r["variant"] for r in data["runs"].values()))
  labels = {r["variant"]: r["label"] for r in data["runs"].values()}
  sweeps = sorted({r["sweep"]["axis"] for r in data["runs"].values() if r["sweep"]})
  transfers = _transfer_points(study, data)
  num_curves = len(study.curves_against)
  panels = 1 + num_curves + len(sweeps) + len(transfers)
  fig = Figure(figsize=(5.5 * panels, 4.2))
  axes = fig.subplots(1, panels)
  colors = {v: matplotlib.colormaps["tab10"](i % 10) for i, v in enumerate(variants)}

  bars = axes[0]
  lowest = []
  for i, v in enumerate(variants):
    values = [scale_of(metric) * metric_value(r["test"], metric) for r in chosen_runs(data, v)]
    if not values:
      continue
    mean, std = _mean_std(values)
    bars.bar(i, mean, yerr=std, color=colors[v], capsize=4, alpha=0.8)
    bars.scatter([i] * len(values), values, color="black", s=10, zorder=3)
    lowest.append(min(values))
  bars.set_xticks(
    range(len(variants)), [labels[v] for v in variants], rotation=20, ha="right", fontsize=8
  )
  bars.set_ylabel(metric_label(metric, "test"))
  if metric in _DERIVED:  # errors: orders of magnitude apart
    bars.set_yscale("log")
  elif metric in _ABSOLUTE and lowest:  # losses differ in the second decimal: zoom in
    bars.set_ylim(bottom=0.95 * min(lowest))
  bars.set_title(f"{study.name}: mean ± std over seeds")

  for curves, against in zip(axes[1 : 1 + num_curves], study.curves_against):
    x_label, x_of = CURVE_AXES[against]
    for v in variants:
      for j, run in enumerate(chosen_runs(data, v)):
        xs = [x_of(run, c) for c in run["curve"]]
        values = [scale_of(study.select) * c[study.select] for c in run["curve"]]
        curves.plot(
          xs, values, color=colors[v], alpha=0.8, lw=1.2, label=labels[v] if j == 0 else None
        )
    curves.set_xlabel(x_label)
    curves.set_ylabel(metric_label(study.select, "validation"))
    curves.set_title("learning curves (every seed, chosen rate)")
    curves.legend(fontsize=7)

  for ax, axis in zip(axes[1 + num_curves :], sweeps):
    points = sorted(
      {data["sweep_bases"][axis]}
      | {
        r["sweep"]["value"]
        for r in data["runs"].values()
        if r["sweep"] and r["sweep"]["axis"] == axis
      }
    )
    for v in variants:
      xs, means, stds = [], [], []
      for x in points:
        values = [
          100 * metric_value(r["test"], metric)
          for r in chosen_runs(data, v, {"axis": axis, "value": x})
        ]
        if values:
          xs.append(x)
          mean, std = _mean_std(values)
          means.append(mean)
          stds.append(std)
      ax.errorbar(xs, means, yerr=stds, color=colors[v], marker="o", capsize=3, label=labels[v])
    ax.set_xlabel(axis)
    ax.set_ylabel(f"test {METRIC_NAMES[metric]} (%)")
    if metric in _DERIVED:
      ax.set_yscale("log")
    ax.set_title(f"sweep: {axis}")
    ax.legend(fontsize=7)

  for ax, (axis, points) in zip(axes[1 + num_curves + len(sweeps) :], transfers.items()):
    for v in variants:
      xs, means, stds = [], [], []
      for x in points:
        values = [100 * metric_value(r["test"], metric) for r in _transfer_runs(data, v, axis, x)]
        if values:
          xs.append(x)
          mean, std = _mean_std(values)
          means.append(mean)
          stds.append(std)
      ax.errorbar(xs, means, yerr=stds, color=colors[v], marker="o", capsize=3, label=labels[v])
    ax.axvline(data["transfer_bases"][axis], color="gray", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{axis} (dotted: trained at)")
    ax.set_ylabel(f"test {METRIC_NAMES[metric]} (%)")
    ax.set_title(f"tested at other {axis}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return fig


def write(study: Study, data: dict[str, Any], out: str) -> tuple[str, str]:
  """Writes `out/STUDY.md` and `out/STUDY.png`; returns their paths."""
  md, png = (os.path.join(out, f"{study.name}.{ext}") for ext in ("md", "png"))
  with open(md, "w") as f:
    f.write(markdown(study, data))
  plot(study, data, png)
  return md, png
