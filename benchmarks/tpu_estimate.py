"""Estimated TPU time of every TPU attention implementation at the paper's shape.

Compiles each case for a compile-only TPU chip and estimates its time from libtpu's
final schedule (`iha_jax.estimate.tpu`): an ESTIMATE from the compiler's
schedule, not a measurement (no TPU runs here). Default cases, at B = 1, N = 8192,
H = 20, d = 128, bf16, causal (IHA: RoPE at virtual positions):

  global_p4, global_p20   global IHA, P = 4 / 20
  window_p4, window_p20   IHA with a window of N / (2P) virtual tokens (the paper's L);
                          window_pP_wW: P and a window of W virtual tokens
  mha                     global multi-head attention (P = 1, no mixing)
  pha_global_pP           global paired-head attention, groups of P heads (not default)
  pha_window_pP[_wW]      PHA with a window of N / (2P) (or W) virtual tokens (not default)
  matmul                  an 8192^3 bf16 matmul (the calibration: ideal 2.40 ms on v5p)

each through every TPU implementation ("xla", "pallas_tpu", "pallas_tpu_window" for
windows, "splash", "auto"), forward and forward+backward (the output and the gradients of
q, k, v and the mixing weights under a random cotangent: the forward's output is used, so
it is never compiled away). "splash" runs at its best blocks per case and pass, searched
among `SPLASH_BLOCKS` (the chosen blocks are printed and written with the row).

    python benchmarks/tpu_estimate.py                       # v5p, every default case
    python benchmarks/tpu_estimate.py --target v6e --cases global_p4,mha --json out.json

`--calibrate` checks the estimator against programs whose time is known independently of
any estimate: an 8192^3 bf16 matmul through XLA and through a Pallas kernel (MXU-bound:
2 * 8192^3 / peak), three identical matmuls (one compiled program, three runs), and a
float32 elementwise op over 1 GiB (HBM-bound: bytes / bandwidth), each with its
tolerance.

`--write_ranking` estimates the default IHA and MHA cases through "pallas_tpu",
"pallas_tpu_window" and "splash" and rewrites `iha_jax/kinds/tpu_ranking.py`, the table
TPU "auto" follows (`iha_jax.kinds.tpu_auto`).

`--json FILE` writes rows {"target", "case", "implementation", "pass", "estimated_ms"}
("pass": "fwd" or "fwd_bwd"; "blocks" where chosen; a case that does not compile has
"estimated_ms": null and its "error"). Needs libtpu (`make targets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
  sys.path.insert(0, str(_REPO))

from iha_jax.estimate import chips  # noqa: E402
from iha_jax.estimate import tpu as tpu_estimate  # noqa: E402
from iha_jax.parallel import targets  # noqa: E402

CASES = ("global_p4", "window_p4", "global_p20", "window_p20", "mha", "matmul")
TPU_IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_tpu_window", "splash", "auto")
# Splash's (query, key) blocks searched per case (compute blocks <= 512: `splash.block_sizes`):
# larger blocks skip more fully masked steps of a global causal band; a window's band
# is narrow, where 512 fits it best (larger ones were slower in every window case tried).
SPLASH_BLOCKS = ((512, 512), (1024, 512), (1024, 1024), (2048, 512), (2048, 1024))
SPLASH_WINDOW_BLOCKS = ((512, 512), (1024, 512))
PASSES = ("fwd", "fwd_bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int = 1
  tokens: int = 8192
  heads: int = 20
  head_dim: int = 128
  matmul: int = 8192


def case_setup(case: str, shape: Shape) -> tuple[str, int, int | None]:
  """`case` -> (kind "iha" / "pha" / "mha" / "matmul", P, window in the kind's units)."""
  if case == "mha":
    return "mha", 1, None
  if case == "matmul":
    return "matmul", 1, None
  if case.startswith("pha_"):  # PHA's cases: IHA's names after "pha_"
    _, pseudo, window = case_setup(case.removeprefix("pha_"), shape)
    if shape.heads % pseudo:
      raise ValueError(case)  # P must divide H
    return "pha", pseudo, window
  name, _, p = case.partition("_p")
  p, _, w = p.partition("_w")  # window_p20_w1638: an explicit window (virtual tokens)
  if name not in ("global", "window") or not p.isdigit() or int(p) < 1:
    raise ValueError(case)
  if w and (name != "window" or not w.isdigit() or int(w) < 1):
    raise ValueError(case)
  pseudo = int(p)
  if name == "global":
    return "iha", pseudo, None
  return "iha", pseudo, int(w) if w else shape.tokens // (2 * pseudo)


def implementations_of(kind: str, windowed: bool = True) -> tuple[str, ...]:
  from iha_jax.kinds import registry  # after the TPU packages are on sys.path

  if kind == "matmul":
    return ("xla",)
  have = set(registry.implementations(kind))
  if not windowed:
    have.discard("pallas_tpu_window")
  return tuple(i for i in TPU_IMPLEMENTATIONS if i in have or i == "auto")


def build(case: str, implementation: str, backward: bool, shape: Shape, device, blocks=None):
  """(jitted function, its ShapeDtypeStruct arguments) of one case."""
  import jax
  import jax.numpy as jnp

  from iha_jax.ops import AttentionOptions, BlockSizes, iha_attention, mha_attention, pha_attention

  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape_, dtype: jax.ShapeDtypeStruct(shape_, dtype, sharding=sharding)
  kind, pseudo, window = case_setup(case, shape)
  if kind == "matmul":
    m = shape.matmul
    x = spec((m, m), jnp.bfloat16)
    return jax.jit(lambda a, b: a @ b), (x, x)
  b, n, h, d = shape.batch, shape.tokens, shape.heads, shape.head_dim
  qkv = [spec((b, n, h, d), jnp.bfloat16)] * 3
  mixing = [spec((h, h, pseudo), jnp.float32)] * 4 if kind == "iha" else []
  options = AttentionOptions(
    window=window,
    implementation=implementation,
    block_sizes=None if blocks is None else BlockSizes(*blocks),
  )
  entry = {"iha": iha_attention, "mha": mha_attention}.get(kind)
  if kind == "pha":
    entry = lambda *arrays: pha_attention(*arrays, num_pseudo=pseudo)

  def forward(*arrays):
    return entry(*arrays, options)

  if not backward:
    return jax.jit(forward), (*qkv, *mixing)

  def loss(*arrays_and_cotangent):
    *arrays, cotangent = arrays_and_cotangent
    out = forward(*arrays)
    return jnp.sum(out.astype(jnp.float32) * cotangent)

  # The loss's value too: training uses the forward's output, so it must run.
  grads = jax.value_and_grad(loss, argnums=tuple(range(len(qkv) + len(mixing))))
  return jax.jit(grads), (*qkv, *mixing, spec((b, n, h, d), jnp.float32))


def ideal_ms(case: str, backward: bool, shape: Shape, chip: chips.Chip) -> float:
  """Unmasked matmul FLOPs (docs/design.md §2) at the chip's bf16 peak, in ms."""
  kind, pseudo, window = case_setup(case, shape)
  if kind == "matmul":
    return 2 * shape.matmul**3 / chip.peak_bf16_flops * 1e3
  t = shape.tokens * pseudo
  pairs = t * (t + 1) / 2 if window is None else t * window - window * (window - 1) / 2
  heads = shape.heads // pseudo if kind == "pha" else shape.heads  # PHA: H/P groups
  flops = 4 * shape.head_dim * pairs * heads * shape.batch
  return flops * (3 if backward else 1) / chip.peak_bf16_flops * 1e3


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="v5p", help="v5p, v5e or v6e (one chip)")
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--implementations", default="", help="default: every TPU one + auto")
  parser.add_argument("--passes", default=",".join(PASSES))
  parser.add_argument("--tokens", type=int, default=Shape.tokens)
  parser.add_argument("--heads", type=int, default=Shape.heads)
  parser.add_argument("--head_dim", type=int, default=Shape.head_dim)
  parser.add_argument("--batch", type=int, default=Shape.batch)
  parser.add_argument("--matmul", type=int, default=Shape.matmul, help="matmul edge")
  parser.add_argument(
    "--blocks", default="", help="tiles to try, e.g. 512x512,1024x512 (default: each's own)"
  )
  parser.add_argument("--json", type=Path, default=None, help="write the rows here")
  parser.add_argument(
    "--rows",
    type=Path,
    default=None,
    help="with --write_ranking: take the estimates from an earlier run's --json file",
  )
  parser.add_argument(
    "--calibrate", action="store_true", help="check the estimator on three known programs"
  )
  parser.add_argument(
    "--write_ranking",
    action="store_true",
    help=f"rewrite {RANKING_FILE.relative_to(_REPO)} (TPU auto's table) from these estimates",
  )
  parser.add_argument("--ops", action="store_true", help="print each estimate's op table")
  parser.add_argument(
    "--keep_schedule", type=Path, default=None, help="copy libtpu's schedules here, per case"
  )
  args = parser.parse_args(argv)
  if args.write_ranking and args.target != "v5p":
    print("tpu_estimate: --write_ranking estimates on v5p (drop --target)", file=sys.stderr)
    return 2
  if args.write_ranking and args.rows is not None:
    rows = [dict(r, pass_=r["pass"]) for r in json.loads(args.rows.read_text())]
    chosen = [r for r in rows if not r.get("blocks") or r.get("searched")]
    write_ranking([r for r in chosen if r["target"] == "v5p"], Shape())
    return 0
  if args.write_ranking:
    args.cases = ",".join(c for c in CASES if c != "matmul")
    args.implementations, args.passes, args.blocks = ",".join(RANKED), ",".join(PASSES), ""

  def fail(message: str) -> int:
    print(f"tpu_estimate: {message}", file=sys.stderr)
    return 2

  generation = args.target.split("-")[0]
  if generation not in chips.CHIPS:
    return fail(f"unknown --target {args.target!r}; choose one of {', '.join(chips.CHIPS)}")
  cases = [c for c in args.cases.split(",") if c]
  shape = Shape(args.batch, args.tokens, args.heads, args.head_dim, args.matmul)
  for case in cases:
    try:
      case_setup(case, shape)
    except ValueError:
      return fail(
        f"unknown case {case!r}; choose among {', '.join(CASES)} (or global_pN/window_pN, "
        "pha_global_pN/pha_window_pN with N dividing the heads)"
      )
  passes = [p for p in args.passes.split(",") if p]
  if set(passes) - set(PASSES):
    return fail(f"unknown --passes {args.passes!r}; choose among {', '.join(PASSES)}")

  tpu_estimate.prepare()
  try:
    devices = targets.devices(
      targets.parse(f"{generation}-8" if generation == "v5p" else f"{generation}-4")
    )
  except targets.TargetError as error:
    return fail(str(error))
  from iha_jax.kinds import registry

  chip = chips.CHIPS[generation]
  if args.calibrate:
    rows = calibrate(chip, devices[0])
    if args.json:
      args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(row["within"] for row in rows) else 1
  rows = []
  caveat = (
    f" {generation} is uncalibrated ({chip.uncalibrated}): compare rows, not absolute times."
    if chip.uncalibrated
    else ""
  )
  print(
    f"Estimated on one {generation} chip from libtpu's final schedule: ESTIMATES, not "
    f"measurements.{caveat} B={shape.batch} N={shape.tokens} H={shape.heads} "
    f"d={shape.head_dim} bf16 causal"
  )
  print(
    f"{'case':<12} {'implementation':<26} {'pass':<8} {'est. ms':>10} {'ideal ms':>9} {'% MXU':>6}"
  )
  estimated: dict[tuple, tpu_estimate.Estimate] = {}

  def one(case: str, implementation: str, pass_: str, blocks) -> tuple[dict, object]:
    """(row, estimate or None) of one case, implementation, pass and tiling."""
    row = dict(target=generation, case=case, implementation=implementation, pass_=pass_)
    if blocks:
      row["blocks"] = list(blocks)
    try:
      with registry.auto_backend("tpu"):
        fn, fn_args = build(case, implementation, pass_ == "fwd_bwd", shape, devices[0], blocks)
        traced = fn.trace(*fn_args)
        # "auto" whose program is one already estimated (the same jaxpr): that estimate.
        program = str(traced.jaxpr)
        est = estimated.get((case, pass_, blocks, program))
        if est is None:
          keep = args.keep_schedule and args.keep_schedule / f"{case}-{implementation}-{pass_}"
          _, est = tpu_estimate.estimate_traced(traced, target=generation, keep_schedule=keep)
          estimated[(case, pass_, blocks, program)] = est
      row["estimated_ms"] = est.seconds * 1e3
      if est.lower_bound:
        row["lower_bound"] = True
    except Exception as error:  # a compile failure is this case's result
      row["estimated_ms"] = None
      row["error"] = (
        str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
      )
      est = None
    return row, est

  given = [tuple(int(x) for x in b.split("x")) for b in args.blocks.split(",") if b]
  for case in cases:
    kind, _, window = case_setup(case, shape)
    wanted = [i for i in args.implementations.split(",") if i] or implementations_of(
      kind, window is not None
    )
    for implementation in wanted:
      if implementation == "pallas_tpu_window" and window is None:
        continue  # the on-chip path takes windows only
      # Splash at its best blocks (searched) unless --blocks names the tilings.
      search = implementation == "splash" and not given
      tilings = given or [None]
      if search:
        rows_of = shape.tokens * case_setup(case, shape)[1]
        searched = SPLASH_BLOCKS if window is None else SPLASH_WINDOW_BLOCKS
        tilings = [b for b in searched if max(b) <= max(rows_of, 512)]
      for pass_ in passes:
        backward = pass_ == "fwd_bwd"
        if kind == "matmul" and backward:
          continue
        start = time.perf_counter()
        tried = [one(case, implementation, pass_, blocks) for blocks in tilings]
        ok = [t for t in tried if t[1] is not None]
        picks = [min(ok, key=lambda t: t[0]["estimated_ms"])] if search and ok else tried
        if search and not ok:
          picks = tried[:1]
        for row, est in picks:
          if search:
            row["searched"] = [list(b) for b in tilings]
          rows.append(row)
          blocks = row.get("blocks")
          label = implementation + (f" {blocks[0]}x{blocks[1]}" if blocks else "")
          if implementation == "auto" and kind != "matmul":
            with registry.auto_backend("tpu"):
              row["resolved"] = _resolved(kind, case, shape)
            label = f"auto ({row['resolved']})"
          ideal = ideal_ms(case, backward, shape, chip)
          if est is None:
            print(
              f"{case:<12} {label:<26} {pass_:<8} {'failed':>10} {ideal:>9.3f}      -  "
              f"{row['error']}"
            )
            continue
          at_least = ">=" if est.lower_bound else "  "
          print(
            f"{case:<12} {label:<26} {pass_:<8} {at_least}{row['estimated_ms']:>8.3f} "
            f"{ideal:>9.3f} {100 * ideal / row['estimated_ms']:>5.0f}%  "
            f"({time.perf_counter() - start:.0f} s)"
            + ("  lower bound: run-time loop trips counted once" if est.lower_bound else "")
            + (f"  best of {len(tilings)} block pairs" if search else "")
          )
          if args.ops:
            print(est.table())
        sys.stdout.flush()
  if args.write_ranking:
    write_ranking(rows, shape)
  if args.json:
    payload = [{("pass" if k == "pass_" else k): v for k, v in row.items()} for row in rows]
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
  return 0


def _three_matmuls(x, w1, w2, w3):
  import jax.numpy as jnp

  for w in (w1, w2, w3):
    x = jnp.tanh(x @ w).astype(x.dtype)
  return x


def _pallas_matmul(edge: int, block: int = 512):
  """`a @ b` for `[edge, edge]` bf16 operands as a Pallas TPU kernel: a grid of
  `block`-square output tiles, each accumulating over the contraction in float32 (the
  kernel's region is MXU-bound: its time is its FLOPs at peak)."""
  import functools

  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  steps = edge // block

  def kernel(a_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == steps - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  call = pl.pallas_call(
    kernel,
    grid=(steps, steps, steps),
    in_specs=[
      pl.BlockSpec((block, block), lambda i, j, k: (i, k)),
      pl.BlockSpec((block, block), lambda i, j, k: (k, j)),
    ],
    out_specs=pl.BlockSpec((block, block), lambda i, j, k: (i, j)),
    out_shape=jax.ShapeDtypeStruct((edge, edge), jnp.bfloat16),
    scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    name="calibration_matmul",
  )
  return jax.jit(functools.partial(call))


def calibrate(chip: chips.Chip, device) -> list[dict]:
  """Estimates programs whose time is known from arithmetic (their FLOPs at the chip's
  peak, or their bytes at its HBM bandwidth) and compares (one row each)."""
  import jax
  import jax.numpy as jnp

  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  m = 8192
  big = spec((8192, 32768), jnp.float32)  # 1 GiB in, 1 GiB out
  programs = [
    (
      "matmul 8192^3 bf16",
      jax.jit(lambda a, b: a @ b),
      (spec((m, m), jnp.bfloat16),) * 2,
      2 * m**3 / chip.peak_bf16_flops,
      0.10,
    ),
    (
      # The MXU floor: a Pallas kernel's bundles undercount the MXU cycles its passes take.
      "Pallas matmul kernel 8192^3 bf16",
      _pallas_matmul(m),
      (spec((m, m), jnp.bfloat16),) * 2,
      2 * m**3 / chip.peak_bf16_flops,
      0.10,
    ),
    (
      # Three ops of one shape: libtpu compiles them once; each must still be counted.
      "3 identical matmuls 4096^3",
      jax.jit(_three_matmuls),
      (spec((4096, 4096), jnp.bfloat16),) * 4,
      3 * 2 * 4096**3 / chip.peak_bf16_flops,
      0.10,
    ),
    (
      "elementwise f32 1 GiB",
      jax.jit(lambda x: x * 2.0 + 1.0),
      (big,),
      2 * big.size * 4 / chip.hbm_bytes_per_s,
      0.15,
    ),
  ]
  rows = []
  print(f"Calibration on one {chip.name} chip (estimates from libtpu's schedule vs known times)")
  for name, fn, args, known_s, tolerance in programs:
    est = tpu_estimate.estimate(fn, *args, target=chip.name)
    error = est.seconds / known_s - 1
    within = abs(error) <= tolerance
    rows.append(
      dict(
        program=name,
        estimated_ms=est.seconds * 1e3,
        known_ms=known_s * 1e3,
        error=error,
        tolerance=tolerance,
        within=within,
      )
    )
    print(
      f"  {name:<33} estimate {est.seconds * 1e3:8.3f} ms  known {known_s * 1e3:8.3f} ms  "
      f"{error:+6.1%} (tolerance {tolerance:.0%}) {'ok' if within else 'OUT OF TOLERANCE'}"
    )
  return rows


RANKING_FILE = _REPO / "iha_jax" / "kinds" / "tpu_ranking.py"
RANKED = ("pallas_tpu", "pallas_tpu_window", "splash")


def write_ranking(rows: list[dict], shape: Shape) -> None:
  """Rewrites `RANKING_FILE` from the estimated rows (both passes of every case)."""
  times: dict[tuple, dict[str, float]] = {}
  for row in rows:
    # Ranked: the kernels. XLA's estimates are lower bounds (run-time loop trips); "auto"
    # is what the ranking picks, not an implementation.
    if row.get("estimated_ms") is None or row["implementation"] not in RANKED:
      continue
    kind, pseudo, window = case_setup(row["case"], shape)
    key = (kind, pseudo, window is not None, row["implementation"])
    times.setdefault(key, {})[row["pass_"]] = row["estimated_ms"]
  entries = [
    f'  ("{kind}", {p}, {windowed}, "{name}", {t["fwd"]:.3f}, {t["fwd_bwd"]:.3f}),'
    for (kind, p, windowed, name), t in sorted(times.items())
    if set(t) == set(PASSES)
  ]
  RANKING_FILE.write_text(
    '"""Generated by `python benchmarks/tpu_estimate.py --write_ranking`: do not edit.\n\n'
    "Estimated on one v5p chip from libtpu's final schedule (estimates, not measurements):\n"
    f"B = {shape.batch}, N = {shape.tokens}, H = {shape.heads}, d = {shape.head_dim}, bf16, "
    "causal; windows of N / (2P) virtual\ntokens. Rows: (kind, P, windowed, "
    'implementation, estimated fwd ms, estimated fwd+bwd ms).\n"""\n\n'
    "RANKING = (\n" + "\n".join(entries) + "\n)\n"
  )
  print(f"wrote {RANKING_FILE.relative_to(_REPO)} ({len(entries)} rows)")


def _resolved(kind: str, case: str, shape: Shape) -> str:
  """What "auto" picks for this case on TPU (given the call's shapes)."""
  import jax
  import jax.numpy as jnp

  from iha_jax.kinds import registry

  _, pseudo, window = case_setup(case, shape)
  q = jax.ShapeDtypeStruct((shape.batch, shape.tokens, shape.heads, shape.head_dim), jnp.bfloat16)
  from iha_jax.ops import AttentionOptions

  return registry.resolve(kind, "auto", q, q, AttentionOptions(window=window), pseudo)


if __name__ == "__main__":
  sys.exit(main())
