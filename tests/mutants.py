"""What the test suite catches: deliberate bugs ("mutants") applied one at a time to a
scratch copy of the repository, the suite run on each until its first failure.

Run from the repository root: `python tests/mutants.py` (all mutants), `--only NAME,NAME`,
`--list`, `--command "..."` (every mutant's command; default each mutant's own, `make test`
unless it says otherwise), `--out FILE` (the markdown table too). Every mutant must be
killed: the exit status is 1 if one survived or could not be applied (its `old` snippet
must occur exactly once in its file, so code drift is noticed).

The copy holds the working tree's tracked files and its untracked, not ignored ones (a new
test counts before it is committed), with `.venv` and `.targets` linked from the repository
so that `make test` reinstalls nothing. Each run gets `PYTEST_ADDOPTS="-x -p no:cacheprovider"`
(stop at the first failure) and `IHA_TESTS_FIRST=<killer>` (tests/conftest.py runs it first).

A control first: the unmutated copy runs each distinct command once, to the end (no `-x`).
A test that fails there fails whatever the mutant (e.g. the README test that runs the code
outside the repository: the linked environment's editable install points at the original
checkout), so it proves nothing: it is reported, and every mutant run of that command
skips it (`--deselect` its id; `--ignore` a module that failed to collect). A control run
that fails without a test failing (make, a crash) stops everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
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
  command: str = "make test"  # what kills it (`make test-rest`: only the `full` tests do)


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
  Mutant(
    "ragged_padding_written",
    "a ragged batch's padding tokens are written into the ring after each row's real ones",
    "iha_jax/nn/cache.py",
    "kept = (steps < counts[:, None]) & (steps >= counts[:, None] - capacity)",
    "kept = steps >= counts[:, None] - capacity",
    "tests/nn/test_ragged_cache.py::test_a_ragged_batch_equals_each_row_alone",
  ),
  # Kernels: each path's mask, scale and segments, per kernel (forward, dQ, dK/dV).
  Mutant(
    "tpu_flash_dq_segments_ignored",
    "TPU flash dQ kernel: segment ids ignored (a query's gradient sees other documents)",
    "iha_jax/kernels/flash/tpu_kernel.py",
    "      p = jnp.exp(s - lse_sc[rows, :])\n      if masked:\n"
    "        segs = (seg_q_ref[rows, :], seg_k_ref[:, cols]) if call.segments else ()\n",
    "      p = jnp.exp(s - lse_sc[rows, :])\n      if masked:\n        segs = ()\n",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[tpu-multi-tile-bidirectional]",
  ),
  Mutant(
    "tpu_flash_dkv_mask_late",
    "TPU flash dK/dV kernel: mask one virtual row late (a key's gradient counts the query "
    "before it)",
    "iha_jax/kernels/flash/tpu_kernel.py",
    "p_t = jnp.where(_visible(call, t_first, s_first, s_t.shape, True, *segs), p_t, 0.0)",
    "p_t = jnp.where(_visible(call, t_first + 1, s_first, s_t.shape, True, *segs), p_t, 0.0)",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[tpu-p4-w9-g1]",
  ),
  Mutant(
    "gpu_flash_forward_mask_late",
    "GPU flash forward kernel: mask one virtual row late (each query sees the next key)",
    "iha_jax/kernels/flash/gpu_kernel.py",
    "    visible = _mask(call, i, j, offset, seg_q, seg_k, transposed=False)\n    m_next",
    "    visible = _mask(call, i, j, offset + 1, seg_q, seg_k, transposed=False)\n    m_next",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[gpu-per-head-no-rope-d15]",
  ),
  Mutant(
    "gpu_flash_dkv_segments_ignored",
    "GPU flash dK/dV kernel: segment ids ignored",
    "iha_jax/kernels/flash/gpu_kernel.py",
    "return ok & (seg_k[:, None] == seg_q[None, :]) if call.segments else ok",
    "return ok",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[gpu-per-head-no-rope-d15]",
  ),
  Mutant(
    "gpu_window_forward_mask_late",
    "on-chip GPU window forward kernel: mask one virtual row late (each pseudo query sees "
    "the next virtual key)",
    "iha_jax/kernels/window/gpu_kernel.py",
    "ok = visible(plan, t, u, qid, lambda: kid_ref[pl.ds(j * rk, rk)])",
    "ok = visible(plan, t + 1, u, qid, lambda: kid_ref[pl.ds(j * rk, rk)])",
    "tests/kernels/test_gpu_window.py::test_gpu_window_matches_reference[causal-p2-d16]",
  ),
  Mutant(
    "gpu_window_dq_documents_merged",
    "on-chip GPU window dQ kernel: every query row takes the first document's id",
    "iha_jax/kernels/window/gpu_backward_kernel.py",
    "_key_scores(side, g, tq, qid, qx1, qx2, key_chunk, j)",
    "_key_scores(side, g, tq, jnp.minimum(qid, 1), qx1, qx2, key_chunk, j)",
    "tests/kernels/test_gpu_window.py::test_gpu_window_matches_reference[causal-p2-d16]",
  ),
  Mutant(
    "gpu_window_dkv_mask_early",
    "on-chip GPU window dK/dV kernel: mask one virtual row early (a key's gradient misses "
    "its own query, counts one past the window)",
    "iha_jax/kernels/window/gpu_backward_kernel.py",
    "  tq = virtual_rows(plan, rows, plan.offset + i * plan.q_tokens, row0)\n",
    "  tq = virtual_rows(plan, rows, plan.offset + i * plan.q_tokens, row0) - 1\n",
    "tests/kernels/test_gpu_window.py::test_gpu_window_matches_reference[causal-p2-d16]",
  ),
  Mutant(
    "gpu_window_alpha_q_grad_unscaled",
    "on-chip GPU window backward: alpha_q's gradient without the softmax scale its constants carry",
    "iha_jax/kernels/window/gpu.py",
    "return alpha(daq, h) * scale, ",
    "return alpha(daq, h), ",
    "tests/kernels/test_gpu_window.py::test_gpu_window_matches_reference[causal-p2-d16]",
  ),
  Mutant(
    "tpu_window_forward_block0_segments",
    "on-chip TPU window forward: every score tile masked by the first tile's query segment ids",
    "iha_jax/kernels/window/tpu_kernel.py",
    "        qb,\n        t0,\n      )",
    "        qb,\n        0,\n      )",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[tpu-window-p2-packed]",
  ),
  Mutant(
    "tpu_window_backward_without_ln2",
    "on-chip TPU window backward: the score gradient without ln 2 (the queries carry log2(e))",
    "iha_jax/kernels/window/tpu_kernel.py",
    "((dp - delta) * (scale * math.log(2)))",
    "((dp - delta) * scale)",
    "tests/kernels/test_kernels.py::test_kernels_match_reference[tpu-window-p2-packed]",
  ),
  Mutant(
    "window_bidirectional_band_narrow",
    "window paths' band (TPU bias, GPU masks), bidirectional: the farthest key after a "
    "query dropped",
    "iha_jax/kernels/window/common.py",
    "ok &= delta >= 0 if causal else delta > -window",
    "ok &= delta >= 0 if causal else delta > -window + 1",
    "tests/kernels/test_gpu_window.py::test_window_band_is_the_masking_rule[False]",
  ),
  # Config -> model -> layer plumbing of the attention options.
  Mutant(
    "model_rope_theta_default",
    "TransformerConfig gives its layers the default RoPE base, not its rope_theta",
    "iha_jax/models/config.py",
    "      rope_theta=self.rope_theta,\n",
    "      rope_theta=None if self.rope_theta is None else 10000.0,\n",
    "tests/models/test_models.py::test_layers_follow_schedule",
  ),
  Mutant(
    "layer_rope_theta_default",
    "an attention layer calls its kind with the default RoPE base, not its rope_theta",
    "iha_jax/kinds/config.py",
    "rope_theta=self.rope_theta if self.record.uses_rope else None,",
    "rope_theta=(self.rope_theta and 10000.0) if self.record.uses_rope else None,",
    "tests/nn/test_layers.py::test_matches_from_scratch_computation",
  ),
  Mutant(
    "model_window_on_global_layers",
    "TransformerConfig gives its global layers the sliding window too",
    "iha_jax/models/config.py",
    "window=getattr(self, window_field) if spec.windowed else None,",
    "window=getattr(self, window_field),",
    "tests/models/test_models.py::test_layers_follow_schedule",
  ),
  Mutant(
    "qk_norm_queries_only",
    "qk_norm normalises the source queries only, not the keys",
    "iha_jax/kinds/base.py",
    'if f"{which}_norm" in params:',
    'if which == "q" and f"{which}_norm" in params:',
    "tests/nn/test_layer_options.py::test_qk_norm_biases_and_output_width_match_a_from_scratch_layer[True-False-iha]",
  ),
  Mutant(
    "value_bias_dropped",
    "use_bias: the value projection's bias bv never added",
    "iha_jax/kinds/base.py",
    'if f"b{which}" in params:',
    'if which != "v" and f"b{which}" in params:',
    "tests/nn/test_layer_options.py::test_qk_norm_biases_and_output_width_match_a_from_scratch_layer[False-True-iha]",
  ),
  # The optimizer chain.
  Mutant(
    "decay_on_stacked_vectors",
    "weight decay on the scanned layers' norm scales (the rank test forgets the stacked axis)",
    "iha_jax/train/optimizer.py",
    "if p.ndim - stacked <= 1 or",
    "if p.ndim <= 1 or",
    "tests/train/test_config.py::test_decay_mask_mixing_switch_and_scanned_shapes",
  ),
  Mutant(
    "clip_after_adamw",
    "global-norm clipping applied to AdamW's update instead of the gradient",
    "iha_jax/train/optimizer.py",
    "optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)",
    "optax.chain(adamw, optax.clip_by_global_norm(train.grad_clip))",
    "tests/train/test_config.py::test_optimizer_clips_the_gradient_before_adamw",
  ),
  # Context parallelism, the estimator.
  Mutant(
    "halo_floor",
    "context parallelism's halo floor((w - 1) / P) tokens, not ceil: where P does not "
    "divide w - 1 a shard misses its window's first key",
    "iha_jax/parallel/context.py",
    "-(-(window - 1) // num_pseudo)",
    "(window - 1) // num_pseudo",
    "tests/parallel/test_context.py::test_halo_and_traffic_arithmetic",
  ),
  Mutant(
    "estimate_region_floor_dropped",
    "TPU estimate: a pl.when region faster than its MXU work at peak is not raised to it",
    "iha_jax/estimate/kernel_cost.py",
    "shortfall += max(0.0, floor - body)",
    "shortfall += 0.0",
    "tests/estimate/test_tpu.py::test_mxu_work_per_region_and_the_floor",
  ),
  Mutant(
    "estimate_hbm_floor_dropped",
    "TPU estimate: an op's time is its bundles alone, never its HBM bytes at bandwidth",
    "iha_jax/estimate/tpu.py",
    "return max(self.bundle_s, self.memory_s)",
    "return self.bundle_s",
    "tests/estimate/test_tpu.py::test_an_op_takes_the_longer_of_its_schedule_and_its_hbm_bytes",
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


def _pytest_opts(skipped: frozenset[str] = frozenset(), first_failure: bool = True) -> str:
  """PYTEST_ADDOPTS of a run: `-x` unless `first_failure` is False (the control), and the
  control's failures left out (a module that failed to collect: ignored)."""
  opts = ["-x"] if first_failure else []
  opts.append("-p no:cacheprovider")
  for test in sorted(skipped):
    opts.append(shlex.quote(f"--deselect={test}" if "::" in test else f"--ignore={test}"))
  return " ".join(opts)


def _run(command: str, copy: pathlib.Path, opts: str, first: str = "") -> tuple[int, str, float]:
  """(exit status, output, seconds) of `command` in `copy`."""
  env = dict(os.environ, PYTEST_ADDOPTS=opts, IHA_TESTS_FIRST=first)
  start = time.monotonic()
  run = subprocess.run(
    command, shell=True, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
  )
  return run.returncode, run.stdout.decode(errors="replace"), time.monotonic() - start


@dataclasses.dataclass
class Control:
  """The unmutated copy's run of one command: the tests that fail there (`failing`), or
  `error` if the command failed without a test failing."""

  command: str
  failing: frozenset[str]
  seconds: float
  error: str = ""


def run_control(command: str) -> Control:
  """Runs `command` in an unmutated scratch copy to the end: which tests fail anyway."""
  copy = scratch_copy()
  try:
    code, output, seconds = _run(command, copy, _pytest_opts(first_failure=False))
  finally:
    shutil.rmtree(copy, ignore_errors=True)
  failing = frozenset(FAILURE.findall(output))
  error = output[-2000:] if code != 0 and not failing else ""
  return Control(command, failing, seconds, error)


def run_mutant(mutant: Mutant, command: str, skipped: frozenset[str] = frozenset()) -> Result:
  """Applies `mutant` in a scratch copy, runs `command` there without the tests in
  `skipped` (those failing in the control), and removes the copy."""
  try:
    apply(mutant, ROOT, dry_run=True)  # before copying: a snippet that drifted fails fast
  except (ValueError, OSError) as e:
    return Result(mutant, "NOT APPLIED", detail=str(e))
  copy = scratch_copy()
  try:
    apply(mutant, copy)
    code, output, seconds = _run(command, copy, _pytest_opts(skipped), mutant.killer)
    if code == 0:
      return Result(mutant, "SURVIVED", seconds=seconds, detail=output[-2000:])
    # (skipped tests do not run; a failure among them would prove nothing all the same)
    found = [test for test in FAILURE.findall(output) if test not in skipped]
    if not found:  # not a test's failure (make, a crash): nothing is proved
      return Result(mutant, "NO TEST FAILED", seconds=seconds, detail=output[-2000:])
    return Result(mutant, "killed", found[0], seconds)
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


def control_notes(controls) -> str:
  """One line per control run: its seconds and the tests it failed (left out after)."""
  lines = []
  for c in controls:
    failing = ", ".join(f"`{test}`" for test in sorted(c.failing)) or "none"
    lines.append(
      f"\nControl (`{c.command}`, unmutated): {c.seconds:.0f} s; failing, left out: {failing}\n"
    )
  return "".join(lines)


def main(argv: list[str] | None = None) -> int:
  """Runs the selected mutants; 1 if one survived or could not be applied."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", help="comma-separated mutant names")
  parser.add_argument("--list", action="store_true", help="print the mutants and exit")
  parser.add_argument("--command", help="run in the copy for every mutant (default: its own)")
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
      print(f"{m.name:24} {m.path}: {m.description} ({m.command}; killer: {m.killer})")
    return 0
  command = lambda m: args.command or m.command
  controls = {}
  for c in dict.fromkeys(command(m) for m in mutants):
    print(f"control: {c} on the unmutated copy ...", file=sys.stderr)
    controls[c] = run_control(c)
    control = controls[c]
    failing = "".join(f"\n  {test}" for test in sorted(control.failing))
    print(
      f"control: {len(control.failing)} failing after {control.seconds:.0f} s{failing}",
      file=sys.stderr,
    )
    if control.error:
      print(f"control: {c} failed without a failing test:\n{control.error}", file=sys.stderr)
      return 1
  results = []
  for m in mutants:
    print(f"mutant {m.name}: {command(m)} ...", file=sys.stderr)
    r = run_mutant(m, command(m), controls[command(m)].failing)
    results.append(r)
    found = f" by {r.killer}" if r.killer else f"\n{r.detail}"  # the run's tail, or why
    print(f"mutant {m.name}: {r.status} after {r.seconds:.0f} s{found}", file=sys.stderr)
  text = table(results) + control_notes(controls.values())
  print(text, end="")
  if args.out:
    pathlib.Path(args.out).write_text(text)
  return 0 if all(r.status == "killed" for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
