"""The TPU time estimator (`iha_jax.estimate.tpu`): its pieces without libtpu,
then, compiled by libtpu for a compile-only v5p (a subprocess, as the compile checks), its
calibration on programs of known time and the regression that keeps the TPU kernels
ahead: by ESTIMATE, never wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from iha_jax.estimate import kernel_grid, llo
from iha_jax.parallel import targets
from tests.fixtures import REPO_ROOT

ROOT = REPO_ROOT

# A made-up schedule in libtpu's format: a 10-trip loop whose body holds a two-bundle
# span a branch may skip (after one empty delay-slot bundle), then a call of an XLA op.
LISTING = """\
= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = inlined_call_operand.hbm [shape: bf16[8,128], index: 0, kind: input]  ;;  \
%s2 = inlined_call_operand.vmem [shape: f32[4], index: 1, kind: output] }
   0x1   :  { %3 = smov 0 } /* Start region 5 */
   0x2 LB: > { %4 = sadd.s32 1, %s3 } /* Start region 7 */
   0x3   : > { %5 = sbr.rel (%p1) target = $region9 }
   0x4   : > {}
   0x5   : > { %6 = vadd.f32 %v1, %v2 }
   0x6   : > { %7 = vadd.f32 %v1, %v2 }
   0x7 PF: > { %8 = smov 1 } /* Start/End empty region 9 */
   0x8   : > { %p9 = scmp.ge.s32.totalorder %s4, 10 /* loop exit test */ }
   0x9   : > { %10 = sbr.rel (!%p9) target = $region7 }
   0xa   :  { %11 = inlined_call %s1 /* %fusion.3 = fusion(%x) */ }
"""


def test_schedule_listing_becomes_loops_spans_and_calls():
  program = llo.parse(LISTING, "kernel")
  (loop,) = program.loops()
  assert loop.trips == 10 and (loop.start, loop.end) == (2, 9)
  (span,) = [n for n in program.root.walk() if n.kind == "span"]
  assert (span.start, span.end) == (5, 6)  # the empty delay slot runs either way
  assert program.cycles() == 3 + 10 * 8  # 3 outside, 8 per trip
  assert program.cycles(span_weight=lambda _: 0.5) == 3 + 10 * 7
  assert program.cycles(call_cycles=lambda name: 100.0) == 83 + 100
  assert program.call_counts() == {"fusion.3": 1.0}
  assert program.hbm_bytes() == 8 * 128 * 2  # the VMEM output moves no HBM bytes
  assert program.unknown_trips == 0


# An outer loop of 20 trips whose exit test is predicated and comes after an inner loop's
# own (the inner one, unrolled by 4 in source, counts its induction variable by 4).
NESTED = """\
     0   :  { %1 = smov 0 }
   0x1 LB: > { %2 = sadd.s32 1, %s1 } /* Start region 3 */
   0x2 LB: >> { %s5 = sadd.s32 4, %s4 } /* Start region 4 */
   0x3   : >> { %p6 = scmp.ge.s32.totalorder %s5, 20 /* loop exit test */ }
   0x4   : >> { %p7 = scmp.ge.s32.totalorder (%p6), %s2, 20 /* loop exit test */ }
   0x5   : >> { %8 = sbr.rel (!%p6) target = $region4 }
   0x6   : > { %9 = sbr.rel (!%p7) target = $region3 }
"""


def test_loop_trips_come_from_the_branch_exit_test_and_the_step():
  """Each loop's trips: the exit test that sets its own branch's predicate (not an inner
  loop's, nor a later predicated one), divided by the induction step (an unrolled loop
  counts by its unroll factor)."""
  program = llo.parse(NESTED, "kernel")
  outer, inner = program.loops()
  assert (outer.start, outer.end, outer.trips) == (1, 6, 20)
  assert (inner.start, inner.end, inner.trips) == (2, 5, 5)


def test_mxu_work_per_region_and_the_floor(monkeypatch):
  """The products a kernel issues, per `pl.when` body and outside them (loops of static
  trips repeated), padded to the MXU's edge; an estimate adds to a region whose bundles
  take less than its MXU work at peak."""
  from iha_jax.estimate import chips, kernel_cost

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(0) == 0)
    def _():
      def body(i, acc):
        return acc + jnp.dot(a_ref[:, :80], b_ref[:80, :], preferred_element_type=jnp.float32)

      o_ref[...] += jax.lax.fori_loop(0, 3, body, jnp.zeros((256, 128), jnp.float32))

  def f(a, b):
    return pl.pallas_call(
      kernel,
      grid=(4,),
      in_specs=[
        pl.BlockSpec((256, 128), lambda i: (0, 0)),
        pl.BlockSpec((128, 128), lambda i: (0, 0)),
      ],
      out_specs=pl.BlockSpec((256, 128), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((1024, 128), jnp.float32),
      name="mxu_probe",
    )(a, b)

  a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  (call,) = kernel_grid.kernel_calls(f, a, jax.ShapeDtypeStruct((128, 128), jnp.bfloat16))
  assert call.mxu_work.flops(128) == 2 * 256 * 128 * 128
  (when,) = call.whens
  # K = 80 is padded to one 128-wide pass; the loop runs three times.
  assert when.mxu_work.flops(128) == 3 * 2 * 256 * 128 * 128
  assert when.steps == (1,)
  # Bundles that take less than the MXU work: the region is charged its MXU time.
  chip = chips.CHIPS["v5p"]
  program = llo.parse(LISTING, "mxu_probe")
  floor = 4 * call.mxu_work.flops(128) / chip.flops_per_core_cycle
  cycles, _ = kernel_cost.kernel_cycles(program, call, chip)
  assert cycles >= floor
  # The listing's bundles are fewer than either region's MXU work: the kernel takes the
  # steps' work outside the pl.when plus the one step's inside it, each at peak.
  when_floor = when.steps[0] * when.mxu_work.flops(128) / chip.flops_per_core_cycle
  assert cycles == pytest.approx(floor + when_floor)
  # The floor per product shape, as the op table prints it: four steps of the 128-deep
  # product, one run of the pl.when's three 80-deep ones.
  rate = chip.flops_per_core_cycle * chip.clock_hz
  products = dict(kernel_cost.kernel_mxu_products(call, chip))
  one = 2 * 256 * 128 * 128 / rate  # one 256-row product, contraction padded to 128
  assert products == pytest.approx({(256, 128, 128): 4 * one, (256, 80, 128): 3 * one})


def test_an_op_takes_the_longer_of_its_schedule_and_its_hbm_bytes():
  """An op is no faster than its bundles nor than its bytes at HBM bandwidth, per run; a
  collective is listed but not counted."""
  from iha_jax.estimate.tpu import OpEstimate

  memory_bound = OpEstimate("fusion.1", "xla", 3.0, bundle_s=2e-3, memory_s=5e-3)
  assert memory_bound.seconds == 5e-3 and memory_bound.total_s == pytest.approx(15e-3)
  bundle_bound = OpEstimate("iha_flash_dkv", "kernel", 2.0, bundle_s=4e-3, memory_s=1e-3)
  assert bundle_bound.seconds == 4e-3 and bundle_bound.total_s == pytest.approx(8e-3)
  assert OpEstimate("all-reduce.2", "collective", 1.0, 1e-3, 1e-3).total_s == 0.0


def test_in_place_slice_updates_are_charged_their_slice():
  """An op that updates a slice of a buffer in place (the input and the output of one
  shape) moves its slice, not the buffer: only its other operands count as HBM bytes."""
  from iha_jax.estimate import tpu as tpu_estimate

  listing = (
    "     0   :  { %s1 = inlined_call_operand.hbm [shape: f32[64,1,8192], index: 0, kind: "
    "input]  ;;  %s2 = inlined_call_operand.hbm [shape: f32[8192], index: 1, kind: input]  ;;  "
    "%s3 = inlined_call_operand.hbm [shape: f32[64,1,8192], index: 2, kind: output] }\n"
  )
  program = llo.parse(listing, "x")
  assert tpu_estimate._xla_bytes("bitcast_dynamic-update-slice_fusion.5", program) == 8192 * 4
  assert tpu_estimate._xla_bytes("fusion.5", program) == (2 * 64 + 1) * 8192 * 4


def _causal_kernel(x):
  """grid (4, 6): pl.when(j == 0) and pl.when(j <= i), one (8, 128) block per step."""

  def kernel(x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(j <= i)
    def _():
      o_ref[...] += x_ref[...]

  return pl.pallas_call(
    kernel,
    grid=(4, 6),
    in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
    out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, 0)),
    out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    name="causal_probe",
  )(x)


def test_kernel_grid_counts_each_pl_when_per_core():
  x = jax.ShapeDtypeStruct((32, 768), jnp.float32)
  (call,) = kernel_grid.kernel_calls(_causal_kernel, x, cores=2)
  assert call.name == "causal_probe" and call.grid == (4, 6) and call.weighted
  # v5p's two cores split the first parallel dimension: rows 0-1 and rows 2-3.
  assert call.core_steps == (12, 12)
  init, compute = call.whens
  assert init.steps == (2, 2)
  assert compute.steps == (1 + 2, 3 + 4)
  # Input blocks change every step; the output block once per row.
  block = 8 * 128 * 4
  assert call.dma_bytes == 24 * block + 4 * block
  (one_core,) = kernel_grid.kernel_calls(_causal_kernel, x, cores=1)
  assert one_core.core_steps == (24,) and one_core.whens[1].steps == (10,)


def test_kernel_grid_reads_splash_mask_tables():
  """splash attention's should-run predicate reads its mask tables (constants of the
  trace): a causal mask of 8 x 8 blocks runs 36 of 64 steps per head."""
  mask = splash.MultiHeadMask([splash.CausalMask((1024, 1024))] * 2)
  kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
  heads = jax.ShapeDtypeStruct((2, 1024, 128), jnp.bfloat16)
  (call,) = kernel_grid.kernel_calls(lambda q, k, v: kernel(q, k, v), heads, heads, heads, cores=2)
  assert call.weighted and call.core_steps == (64, 64)
  assert [w.steps for w in call.whens] == [(8, 8), (36, 36), (8, 8)]


# --- TPU "auto" by estimate ---------------------------------------------------------------


def test_tpu_auto_takes_the_fastest_ranked_and_never_one_slower_than_splash():
  """Every class of the committed ranking: "auto" picks its fastest row by
  forward+backward (never one estimated slower than `splash`), and never `splash` for a
  sequence shard or above the materialisation limit."""
  from iha_jax.kinds import tpu_auto

  classes = tpu_auto.classes()
  assert classes, "the ranking is empty: python benchmarks/tpu_estimate.py --write_ranking"
  for (kind, pseudo, windowed), rows in classes.items():
    names = [row[3] for row in rows]
    chosen = tpu_auto.choose(kind, pseudo, windowed, names, sliced=False, small=True)
    by_name = {row[3]: row for row in rows}
    assert by_name[chosen][5] == min(row[5] for row in rows), (kind, pseudo, windowed)
    if "splash" in by_name:
      assert by_name[chosen][5] <= by_name["splash"][5]
    for sliced, small in ((True, True), (False, False)):
      assert tpu_auto.choose(kind, pseudo, windowed, names, sliced=sliced, small=small) != "splash"


def test_registry_resolves_tpu_auto_through_the_ranking(monkeypatch):
  """On TPU, "auto" is the ranking's choice for the call's class (nearest P): a ranking
  that puts `splash` first makes "auto" `splash`, except for a sequence shard."""
  from iha_jax.kinds import registry, tpu_auto, tpu_ranking
  from iha_jax.ops import AttentionOptions

  q = jax.ShapeDtypeStruct((1, 256, 4, 32), jnp.bfloat16)
  flipped = tuple(
    (*row[:4], row[4], 0.0 if row[3] == "splash" else row[5]) for row in tpu_ranking.RANKING
  )
  fastest = tpu_auto.classes()[("iha", 4, False)][0][3]  # P = 3's nearest class: P = 4
  with registry.auto_backend("tpu"):
    assert registry.resolve("iha", "auto", q, q, AttentionOptions(), 3) == fastest
    monkeypatch.setattr(tpu_ranking, "RANKING", flipped)
    assert registry.resolve("iha", "auto", q, q, AttentionOptions(window=64), 3) == "splash"
    assert registry.resolve("mha", "auto", q, q, AttentionOptions(), 1) == "splash"
    sliced = registry.resolve("iha", "auto", q, q, AttentionOptions(), 3, sliced=True)
    assert sliced == "pallas_tpu"


def test_tpu_auto_takes_the_onchip_window_path_where_ranked_and_able(monkeypatch):
  """A window at the paper's P = H takes the on-chip path where the ranking puts it first;
  a call it cannot take (head_dim 256: wider than its 128-lane rows) falls back to the next
  ranked implementation; a global call never takes it."""
  from iha_jax.kinds import registry, tpu_ranking
  from iha_jax.ops import AttentionOptions

  rows = (
    ("iha", 20, True, "pallas_tpu_window", 1.0, 2.0),
    ("iha", 20, True, "pallas_tpu", 2.0, 3.0),
    ("iha", 20, False, "pallas_tpu", 2.0, 3.0),
  )
  monkeypatch.setattr(tpu_ranking, "RANKING", rows)
  window = AttentionOptions(window=204)
  with registry.auto_backend("tpu"):
    for d, expected in ((128, "pallas_tpu_window"), (256, "pallas_tpu")):
      q = jax.ShapeDtypeStruct((1, 2048, 20, d), jnp.bfloat16)
      assert registry.resolve("iha", "auto", q, q, window, 20) == expected, d
    q = jax.ShapeDtypeStruct((1, 2048, 20, 128), jnp.bfloat16)
    assert registry.resolve("iha", "auto", q, q, AttentionOptions(), 20) == "pallas_tpu"


# --- compiled by libtpu (subprocess) -------------------------------------------------------

needs_tpu = pytest.mark.skipif(
  not targets.packages_dir("tpu").is_dir() and not os.environ.get("IHA_REQUIRE_TARGETS"),
  reason="libtpu missing: `make targets` (make test installs it)",
)


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  return subprocess.run(
    [sys.executable, "benchmarks/tpu_estimate.py", *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=timeout,
  )


@pytest.mark.full
@needs_tpu
def test_calibration_on_known_programs(tmp_path):
  """Against times known from arithmetic alone: an 8192^3 bf16 matmul through XLA and
  through a Pallas kernel (whose bundles alone undercount its MXU time: the MXU floor)
  within 10% of its FLOPs at peak, three identical matmuls (one compiled program, three
  runs) within 10%, a float32 elementwise op within 15% of its bytes at HBM bandwidth."""
  out = tmp_path / "calibration.json"
  proc = _cli("--calibrate", "--json", str(out))
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r["program"] for r in rows] == [
    "matmul 8192^3 bf16",
    "Pallas matmul kernel 8192^3 bf16",
    "3 identical matmuls 4096^3",
    "elementwise f32 1 GiB",
  ]
  assert all(r["within"] for r in rows), rows
  assert "estimate" in proc.stdout


@pytest.mark.full
@needs_tpu
def test_tpu_kernels_beat_splash_by_estimate(tmp_path):
  """At a small paper-like shape (N = 2048, H = 4, P = 4; global and window), training
  (forward+backward): the TPU kernels are estimated faster than materialised pseudo
  q/k/v + splash, and "auto" never slower than the splash path."""
  out = tmp_path / "rows.json"
  proc = _cli(
    "--cases", "global_p4,window_p4", "--tokens", "2048", "--heads", "4",
    "--implementations", "pallas_tpu,splash,auto", "--passes", "fwd_bwd", "--json", str(out),
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert all(r["pass"] == "fwd_bwd" and r["target"] == "v5p" for r in rows)
  for case in ("global_p4", "window_p4"):
    ms = {r["implementation"]: r["estimated_ms"] for r in rows if r["case"] == case}
    assert ms["pallas_tpu"] < ms["splash"], (case, ms)
    assert ms["auto"] <= ms["splash"], (case, ms)


@pytest.mark.full
@needs_tpu
def test_onchip_window_path_beats_the_materialised_one_at_p_equals_h(tmp_path):
  """At a small P = H shape (N = 2048, H = P = 20, the paper's window N / (2P)), training:
  the on-chip window path (pseudo-heads never in HBM) is estimated faster than
  materialised pseudo q/k/v + the flash kernels, and TPU "auto" picks it."""
  out = tmp_path / "rows.json"
  proc = _cli(
    "--cases", "window_p20", "--tokens", "2048", "--heads", "20",
    "--implementations", "pallas_tpu,pallas_tpu_window,auto", "--passes", "fwd_bwd",
    "--json", str(out),
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  rows = {r["implementation"]: r for r in json.loads(out.read_text())}
  assert rows["pallas_tpu_window"]["estimated_ms"] < rows["pallas_tpu"]["estimated_ms"], rows
  assert rows["auto"]["resolved"] == "pallas_tpu_window", rows["auto"]


@pytest.mark.parametrize(
  "args, expected",
  [
    (("--target", "v9"), "unknown --target 'v9'; choose one of v5p, v5e, v6e"),
    (("--cases", "global_p4,nope"), "unknown case 'nope'; choose among global_p4"),
    (("--cases", "matmul"), "make targets"),  # libtpu missing (an empty targets folder)
  ],
)
def test_bad_input_is_one_line(args, expected, tmp_path, monkeypatch):
  monkeypatch.setenv("IHA_TARGETS_DIR", str(tmp_path))
  proc = _cli(*args, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert lines[0].startswith("tpu_estimate: ") and expected in lines[0]


def test_schedule_profile_charges_each_loop_its_trips():
  from benchmarks import schedule_profile

  rows = schedule_profile.profile(LISTING)
  program, loop = rows
  assert (program.kind, program.issued, program.share) == ("program", 83, 1.0)
  # 8 bundles per trip, 10 trips; the skippable span's two vadds count as the loop's own.
  assert (loop.kind, loop.trips, loop.issued) == ("loop", 10, 80)
  assert dict(loop.ops) == {"vadd": 2}
  assert "loop" in schedule_profile.table(rows) and "ESTIMATE" in schedule_profile.table(rows)
