"""Runs a study under the project's comparison protocol and writes its results.

  python -m experiments.run STUDY [--scale tiny|small|paper|demo] [--seeds N] [--out DIR]

Writes `DIR/STUDY.json` (every run: variant, learning rate, seed, steps, parameters,
attention FLOPs per token, validation and test metrics, learning curve, wall time),
`DIR/STUDY.md` and `DIR/STUDY.png`. Finished runs are skipped when rerun. Parts run
apart (`--variants` per process or host, each with its own `--out`) are joined with
`--merge DIR1,DIR2 --out DIR`, which trains nothing and rewrites the report.
Studies: relcomp_binary, relcomp_ternary, mqar, cpm3, cpm3_mlp, polynomial_filter,
multikey_retrieval, code_lm.
"""

from __future__ import annotations

import argparse
import os

from absl import logging as absl_logging

from experiments import protocol, report
from experiments.studies import STUDIES


def main(argv: list[str] | None = None) -> tuple[str, str]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("study", choices=sorted(STUDIES))
  parser.add_argument(
    "--scale",
    default="small",
    help="tiny | small | paper; mqar also has demo (`make train`'s setting)",
  )
  parser.add_argument(
    "--seeds",
    type=int,
    default=3,
    help="seeds at the chosen rate (>= 3 for a published comparison)",
  )
  parser.add_argument("--out", default="runs/studies", help="output directory")
  parser.add_argument(
    "--data_dir", default=None, help="dataset directory (default: $IHA_DATA_DIR, else OUT/data)"
  )
  parser.add_argument(
    "--variants", default="", help="comma-separated variant names to run (default: all)"
  )
  parser.add_argument(
    "--merge",
    default="",
    help="comma-separated output directories of parts of this study to join into --out",
  )
  parser.add_argument("--quiet", action="store_true", help="no progress bars")
  args = parser.parse_args(argv)
  study = STUDIES[args.study]
  if args.scale not in study.scales:
    parser.error(f"--scale {args.scale!r}: {study.name} has scales {', '.join(study.scales)}")
  absl_logging.set_verbosity(absl_logging.ERROR)  # TFDS notes on every dataset access
  data_dir = args.data_dir or os.environ.get("IHA_DATA_DIR") or os.path.join(args.out, "data")
  variants = [v for v in args.variants.split(",") if v] or None
  sources = [d for d in args.merge.split(",") if d]
  if sources and variants:
    parser.error("--merge joins finished parts; it takes no --variants")
  if sources:
    data = protocol.merge_studies(study, args.scale, sources, args.out)
  else:
    data = protocol.run_study(
      study,
      args.scale,
      args.seeds,
      args.out,
      os.path.abspath(data_dir),
      progress=not args.quiet,
      variants=variants,
    )
  md, png = report.write(study, data, args.out)
  print(f"wrote {os.path.join(args.out, study.name + '.json')}, {md}, {png}")
  return md, png


if __name__ == "__main__":
  main()
