"""A study's variants' CPU train-step times side by side, with each one's ratio to one of them.

    python benchmarks/study_step_time.py code_lm [--scale small] [--variants a,b,...]
        [--reference mha] [--rounds 5] [--steps 8] [--data_dir DIR]

Compiles each variant's train step as the study runs it (`CompiledVariant`: one device,
the study's model, batch and sequence length) and feeds it one of the study's batches.
After two warm-up steps each, every round times `--steps` steps of every variant in turn,
so a load on the machine falls on all of them alike; the table gives each variant's
median over the rounds, its ratio to `--reference`, and its model FLOPs per step
(docs/design.md §2) with their ratio. Times are this machine's: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import protocol  # noqa: E402
from experiments.studies import STUDIES  # noqa: E402
from experiments.variant_runs import CompiledVariant  # noqa: E402
from iha_jax.train import inputs  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("study", choices=sorted(STUDIES))
  parser.add_argument("--scale", default="small")
  parser.add_argument("--variants", default="", help="comma-separated (default: all)")
  parser.add_argument("--reference", default="mha", help="the variant ratios are taken to")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
  parser.add_argument("--data_dir", default=os.environ.get("IHA_DATA_DIR", "runs/studies/data"))
  args = parser.parse_args(argv)
  study = STUDIES[args.study]
  names = [v for v in args.variants.split(",") if v]
  variants = [v for v in study.contenders(args.scale) if not names or v.name in names]
  if args.reference not in {v.name for v in variants}:
    parser.error(f"--reference {args.reference!r} is not among the variants timed")
  compiled, states, batches = {}, {}, {}
  for variant in variants:
    config = protocol.variant_config(study, args.scale, variant, os.path.abspath(args.data_dir))
    if study.prepare is not None:
      study.prepare(config, args.scale)
    inputs.prepare(config)
    compiled[variant.name] = CompiledVariant(config)
    batches[variant.name] = compiled[variant.name].one_batch()
    states[variant.name], _ = compiled[variant.name].timed_steps(None, batches[variant.name], 2)
  times: dict[str, list[float]] = {name: [] for name in compiled}
  for _ in range(args.rounds):
    for name, target in compiled.items():
      states[name], seconds = target.timed_steps(states[name], batches[name], args.steps)
      times[name].append(seconds)
  reference = statistics.median(times[args.reference])
  reference_flops = compiled[args.reference].train_flops_per_step
  rows = []
  print(
    f"CPU train step of {study.name} ({args.scale}), the median of {args.rounds} rounds of "
    f"{args.steps} steps"
  )
  print("| variant | P | ms per step | ratio | train GFLOPs per step | FLOP ratio |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, target in compiled.items():
    ms = 1e3 * statistics.median(times[name])
    row = dict(
      variant=name,
      num_pseudo=target.num_pseudo,
      ms=ms,
      ratio=ms / (1e3 * reference),
      train_flops=target.train_flops_per_step,
      flop_ratio=target.train_flops_per_step / reference_flops,
    )
    rows.append(row)
    print(
      f"| {name} | {row['num_pseudo'] or '-'} | {ms:.0f} | {row['ratio']:.2f} | "
      f"{row['train_flops'] / 1e9:.1f} | {row['flop_ratio']:.2f} |"
    )
  return rows


if __name__ == "__main__":
  main()
