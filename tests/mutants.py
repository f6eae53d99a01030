"""What the test suite catches: deliberate bugs ("mutants") applied one at a time to a
scratch copy of the repository, the suite run on each until its first failure.

Run from the repository root: `python tests/mutants.py` (all mutants), `--only NAME,NAME`,
`--list`, `--command "..."` (default `make test`), `--out FILE` (the markdown table too).
Every mutant must be killed: the exit status is 1 if one survived or could not be applied
(its `old` snippet must occur exactly once in its file, so code drift is noticed).

The copy holds the working tree's tracked files and its untracked, not ignored ones (a new
test counts before it is committed), with `.venv` and `.targets` linked from the repository
so that `make test` reinstalls nothing. Each run gets `PYTEST_ADDOPTS="-x -p no:cacheprovider"`
(stop at the first failure) and `IHA_TESTS_FIRST=<killer>` (tests/conftest.py runs it first).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Installed environments, linked into the copy; their stamps must stay newer than the
# copy's install inputs, or make would reinstall through the link into the repository's.
LINKED = (".venv", ".venv-newest", ".targets", ".targets-newest")
INSTALL_INPUTS = ("pyproject.toml", "requirements*.txt")
FAILURE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One deliberate bug: `old` (exactly once in `path`) replaced by `new`."""

  name: str
  description: str
  path: str
  old: str
  new: str
  killer: str  # the test that killed it last time: run first


MUTANTS: list[Mutant] = [
  Mutant(
    "causal_off_by_one",
    "causal mask lets each virtual query see the next virtual token",
    "iha_jax/core/masking.py",
    "mask = delta >= 0 if causal",
    "mask = delta >= -1 if causal",
    "tests/core/test_reference.py::test_reference_matches_naive_loop",
  ),
  Mutant(
    "rope_token_position",
    "pseudo-tokens rotated at their token position pos, not pos*P + p",
    "iha_jax/core/interleave.py",
    "(positions[:, :, None] * num_pseudo + offsets)",
    "(positions[:, :, None] + 0 * offsets)",
    "tests/core/test_reference.py::test_reference_matches_naive_loop",
  ),
  Mutant(
    "collapse_axes_swapped",
    "XLA path's collapse reads collapse[h', h, p] instead of collapse[h, h', p]",
    "iha_jax/core/mixing.py",
    'spec = "bgnpd,hgp->bnhd"',
    'spec = "bgnpd,ghp->bnhd"',
    "tests/kinds/test_attention_kinds.py::test_xla_matches_reference",
  ),
  Mutant(
    "gqa_group_shift",
    "XLA grouped-query: query head h reads key/value group (h // (H/G) + 1) % G",
    "iha_jax/core/grouped.py",
    "out = flash_attention_heads_major(q, k, v, mask,",
    "out = flash_attention_heads_major(q, jnp.roll(k, -1, 1), jnp.roll(v, -1, 1), mask,",
    "tests/kinds/test_gqa.py::test_every_implementation_matches_the_loop_reference",
  ),
  Mutant(
    "kernel_window_too_wide",
    "TPU flash kernel's mask: window one virtual token too wide",
    "iha_jax/kernels/flash/tpu_kernel.py",
    "ok = tiles.visible(t, s)\n",
    "ok = tiles.visible(t, s) | tiles.visible(t - 1, s)\n",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[tpu-p4-w9-g1]",
  ),
  Mutant(
    "onchip_keys_overwritten",
    "on-chip TPU window backward: a score tile overwrites 16 key-gradient rows an earlier "
    "tile added to",
    "iha_jax/kernels/window/tpu_kernel.py",
    "  shared = kb - cq\n",
    "  shared = kb - cq - 16\n",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[tpu-window-p2-packed]",
  ),
  Mutant(
    "gpu_one_token_weight_rows",
    "on-chip GPU window backward: a one-token group folds its weight partials without its "
    "last pseudo row (the paper's P = H key groups)",
    "iha_jax/kernels/window/gpu_mixing.py",
    "pair = _first_rows(x, pa), ",
    "pair = _first_rows(x, pa - 1), ",
    "tests/kernels/test_gpu_window.py::test_gpu_window_matches_reference[one-token-groups-p9]",
  ),
  Mutant(
    "band_edge",
    "the band rule (XLA key blocks, kernel tiles): a block whose last key is the window's "
    "first is skipped",
    "iha_jax/core/masking.py",
    "meet = meet & (s_last > t_first - window)\n",
    "meet = meet & (s_last > t_first - window + 1)\n",
    "tests/kinds/test_attention_kinds.py::test_xla_band_reaches_the_window_edge_at_every_width",
  ),
  Mutant(
    "dropout_unscaled",
    "attention dropout keeps weights without the 1 / (1 - rate) scale",
    "iha_jax/core/xla_attention.py",
    "jnp.where(keep, p / (1 - rate), 0.0)",
    "jnp.where(keep, p, 0.0)",
    "tests/kinds/test_attention_kinds.py::test_xla_attention_dropout_is_dense_attention_with_the_tile_masks",
  ),
  Mutant(
    "checkpoint_unverified",
    "restore skips the state's checksum verification",
    "iha_jax/train/checkpoint.py",
    "    integrity.verify_tree(checksums, state)\n",
    "    pass  # checksums not verified\n",
    "tests/train/test_train.py::test_corrupt_array_bytes_fail_their_checksums_then_a_full_disk_keeps_step_4",
  ),
  Mutant(
    "loss_ignores_padding",
    "loss weights all ones: padding positions counted in the loss",
    "iha_jax/train/losses.py",
    'weights = batch["weights"].astype(jnp.float32)',
    'weights = jnp.ones_like(batch["weights"], jnp.float32)',
    "tests/train/test_losses.py::test_padding_positions_add_nothing_to_the_loss",
  ),
  Mutant(
    "cache_slot_late",
    "decode cache writes token t into slot (t + 1) % C",
    "iha_jax/nn/cache.py",
    "jnp.mod(start[:, None] + steps, capacity)",
    "jnp.mod(start[:, None] + steps + 1, capacity)",
    "tests/models/test_decode.py::test_cached_logits_equal_full_forward",
  ),
]


def apply(mutant: Mutant, root: pathlib.Path, dry_run: bool = False) -> None:
  """Applies `mutant` to the file under `root` (only checks it if `dry_run`); ValueError
  unless `old` occurs exactly once."""
  file = root / mutant.path
  text = file.read_text()
  count = text.count(mutant.old)
  if count != 1:
    raise ValueError(
      f"mutant {mutant.name}: its snippet occurs {count} times in {mutant.path}, not exactly "
      f"once (the code changed: update MUTANTS): {mutant.old!r}"
    )
  if not dry_run:
    file.write_text(text.replace(mutant.old, mutant.new))


def scratch_copy() -> pathlib.Path:
  """A temporary copy of the working tree (tracked and untracked, not ignored, files) with
  the installed environments linked in."""
  dest = pathlib.Path(tempfile.mkdtemp(prefix="iha-mutant-"))
  listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    check=True,
    capture_output=True,
  ).stdout
  for name in sorted(set(filter(None, listed.decode().split("\0")))):
    source = ROOT / name
    if not os.path.lexists(source) or source.is_dir():  # deleted; a submodule
      continue
    (dest / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, dest / name, follow_symlinks=False)
  stamps = [(ROOT / d / ".installed") for d in LINKED if (ROOT / d / ".installed").exists()]
  for name in LINKED:
    if (ROOT / name).exists():
      (dest / name).symlink_to(ROOT / name)
  if stamps:  # never newer than the stamps (pyproject.toml is edited more often than installs)
    oldest = min(s.stat().st_mtime for s in stamps) - 1
    for pattern in INSTALL_INPUTS:
      for file in dest.glob(pattern):
        mtime = min(file.stat().st_mtime, oldest)
        os.utime(file, (mtime, mtime))
  return dest


@dataclasses.dataclass
class Result:
  """One mutant's run: `killer` the first failing test ("" if none), `status` one word."""

  mutant: Mutant
  status: str  # killed, SURVIVED, NOT APPLIED, NO TEST FAILED (exit != 0 all the same)
  killer: str = ""
  seconds: float = 0.0
  detail: str = ""


def run_mutant(mutant: Mutant, command: str) -> Result:
  """Applies `mutant` in a scratch copy, runs `command` there, and removes the copy."""
  try:
    apply(mutant, ROOT, dry_run=True)  # before copying: a snippet that drifted fails fast
  except (ValueError, OSError) as e:
    return Result(mutant, "NOT APPLIED", detail=str(e))
  copy = scratch_copy()
  try:
    apply(mutant, copy)
    env = dict(os.environ, PYTEST_ADDOPTS="-x -p no:cacheprovider", IHA_TESTS_FIRST=mutant.killer)
    start = time.monotonic()
    run = subprocess.run(
      command, shell=True, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    seconds = time.monotonic() - start
    output = run.stdout.decode(errors="replace")
    if run.returncode == 0:
      return Result(mutant, "SURVIVED", seconds=seconds, detail=output[-2000:])
    found = FAILURE.search(output)
    if not found:  # not a test's failure (make, a crash): nothing is proved
      return Result(mutant, "NO TEST FAILED", seconds=seconds, detail=output[-2000:])
    return Result(mutant, "killed", found.group(1), seconds)
  finally:
    shutil.rmtree(copy, ignore_errors=True)


def table(results: list[Result]) -> str:
  """The markdown table of `results`."""
  lines = [
    "| mutant | what | first failing test | seconds to first failure |",
    "| --- | --- | --- | --- |",
  ]
  for r in results:
    first = f"`{r.killer}`" if r.status == "killed" else f"**{r.status}**"
    seconds = f"{r.seconds:.0f}" if r.status != "NOT APPLIED" else "-"
    lines.append(f"| `{r.mutant.name}` | {r.mutant.description} | {first} | {seconds} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  """Runs the selected mutants; 1 if one survived or could not be applied."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", help="comma-separated mutant names")
  parser.add_argument("--list", action="store_true", help="print the mutants and exit")
  parser.add_argument("--command", default="make test", help="run in the copy (%(default)s)")
  parser.add_argument("--out", help="also write the markdown table to this file")
  args = parser.parse_args(argv)
  mutants = MUTANTS
  if args.only:
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
      parser.error(f"unknown mutants {unknown}; known: {[m.name for m in MUTANTS]}")
    mutants = [m for m in MUTANTS if m.name in names]
  if args.list:
    for m in mutants:
      print(f"{m.name:24} {m.path}: {m.description} (killer: {m.killer})")
    return 0
  results = []
  for m in mutants:
    print(f"mutant {m.name}: {args.command} ...", file=sys.stderr)
    r = run_mutant(m, args.command)
    results.append(r)
    found = f" by {r.killer}" if r.killer else f"\n{r.detail}"  # the run's tail, or why
    print(f"mutant {m.name}: {r.status} after {r.seconds:.0f} s{found}", file=sys.stderr)
  text = table(results)
  print(text, end="")
  if args.out:
    pathlib.Path(args.out).write_text(text)
  return 0 if all(r.status == "killed" for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
