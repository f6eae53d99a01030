"""The collective model: HLO text read right, ring and link arithmetic, the schedule's
overlap replayed (synthetic programs; libtpu's own in `benchmarks/ici_calibration.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from iha_jax.estimate import hlo, ici
from iha_jax.parallel import targets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = ici.LINK_BYTES_PER_S["v5p"]


@dataclasses.dataclass
class Chip:
  coords: tuple[int, int, int]


def slice_of(x: int, y: int, z: int) -> list[Chip]:
  return [Chip((i, j, k)) for k in range(z) for j in range(y) for i in range(x)]


# fmt: off
# A scanned body (2 trips) hiding an async all-gather behind a fusion, then a synchronous
# all-reduce at the top level. Operand shapes decide the bytes: 4 MiB gathered per chip.
PROGRAM = """HloModule step, is_scheduled=true

%body (p: (s32[], f32[256,1024])) -> (s32[], f32[256,1024]) {
  %p = (s32[], f32[256,1024]{1,0}) parameter(0)
  %x = f32[256,1024]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %all-gather-start = (f32[256,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[16,4]<=[64], dimensions={0}
  %fusion.1 = f32[256,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %all-gather-done = f32[1024,1024]{1,0} all-gather-done(%all-gather-start)
  ROOT %t = (s32[], f32[256,1024]{1,0}) tuple(%p, %fusion.1)
}

ENTRY %main (a: f32[256,1024]) -> f32[256,1024] {
  %a = f32[256,1024]{1,0} parameter(0)
  %while = (s32[], f32[256,1024]{1,0}) while(%a), condition=%cond, body=%body
  %fusion.2 = f32[256,1024]{1,0} fusion(%a), kind=kLoop, calls=%fused2
  ROOT %all-reduce = f32[256,1024]{1,0} all-reduce(%fusion.2), channel_id=2, replica_groups=mesh['axis_0'=16,'axis_1'=4] {'axis_1'}, to_apply=%add
}
"""  # noqa: E501
# fmt: on


def test_the_text_becomes_computations_in_schedule_order_with_shapes_in_bytes():
  module = hlo.parse(PROGRAM)
  assert module.entry == "main"
  body = [i.name for i in module.computations["body"]]
  assert body == ["p", "x", "all-gather-start", "fusion.1", "all-gather-done", "t"]
  start = module.computations["body"][2]
  assert start.opcode == "all-gather-start" and start.operands == ("x",)
  assert hlo.shape_bytes("f32[256,1024]{1,0:T(8,128)}") == 256 * 1024 * 4
  assert hlo.shape_bytes("(bf16[2,3]{1,0}, s32[], u32[]{:S(2)})") == 2 * 6 + 4 + 4
  assert module.computations["main"][1].called() == {"condition": "cond", "body": "body"}


@pytest.mark.parametrize(
  "attributes, expected",
  [
    ("replica_groups={{0,2},{1,3}}, dimensions={0}", [[0, 2], [1, 3]]),
    ("replica_groups=[2,2]<=[4], x=1", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0), x=1", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}, x=1", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'b'}, x=1", [[0, 1], [2, 3]]),
    ("replica_groups={}, x=1", [[0, 1, 2, 3]]),
  ],
)
def test_every_spelling_of_replica_groups(attributes, expected):
  assert hlo.replica_groups(attributes, 4) == expected


def test_ring_all_gather_is_the_arithmetic_and_a_line_half_as_fast():
  volume = 64 * 2**20
  cube = ici.Topology.of(slice_of(4, 4, 4))  # whole cube: every axis a ring
  seconds, words, _ = ici.collective_time("all-gather", volume, [[0, 1, 2, 3]], [], cube)
  assert seconds == pytest.approx(3 / 4 * volume / (2 * LINK), rel=1e-9)
  assert "x ring 4" in words
  line = ici.Topology.of(slice_of(4, 4, 2))  # not whole cubes: lines
  assert ici.collective_time("all-gather", volume, [[0, 1, 2, 3]], [], line)[0] == (
    pytest.approx(2 * seconds)
  )
  reduced = ici.collective_time("all-reduce", volume, [[0, 1, 2, 3]], [], cube)[0]
  assert reduced == pytest.approx(2 * seconds)
  plane = [[i + 4 * j for j in range(4) for i in range(4)]]  # x and y rings: 4 links
  planar = ici.collective_time("all-gather", volume, plane, [], cube)[0]
  assert planar == pytest.approx(15 / 16 * volume / (4 * LINK))


def test_a_permute_costs_its_most_loaded_link():
  cube = ici.Topology.of(slice_of(4, 4, 4))
  assert len(cube.route((0, 0, 0), (3, 0, 0))) == 1  # the wraparound link
  shift = [(i, (i + 1) % 4) for i in range(4)]  # one hop each, distinct links
  assert ici.collective_time("collective-permute", 1e9, None, shift, cube)[0] == (
    pytest.approx(1e9 / LINK)
  )
  both = [(0, 2), (1, 2)]  # 0 -> 2 crosses 1 -> 2's link too
  assert ici.collective_time("collective-permute", 1e9, None, both, cube)[0] == (
    pytest.approx(2e9 / LINK)
  )


def test_the_replay_hides_what_the_schedule_overlaps_and_exposes_the_rest():
  devices = slice_of(4, 4, 4)
  gather_s = 3 / 4 * (1024 * 1024 * 4) / (2 * LINK)
  reduce_s = 2 * 3 / 4 * (256 * 1024 * 4) / (2 * LINK)
  fusion_s = gather_s / 4  # hides a quarter of the gather
  comm = ici.communication(
    PROGRAM,
    devices,
    op_seconds={"fusion.1": fusion_s, "fusion.2": 1e-6},
    op_runs={"fusion.1": 2.0, "fusion.2": 1.0},  # the loop runs twice
  )
  found = {c.name: c for c in comm.collectives}
  gather, reduce = found["all-gather-start"], found["all-reduce"]
  assert gather.asynchronous and gather.runs == 2 and not reduce.asynchronous
  assert gather.bytes == 1024 * 1024 * 4 and "x ring 4" in gather.group
  assert gather.seconds == pytest.approx(gather_s)
  assert gather.exposed_s == pytest.approx(2 * (gather_s - fusion_s))
  assert reduce.exposed_s == pytest.approx(reduce_s)
  assert comm.total_s == pytest.approx(2 * gather_s + reduce_s)
  assert comm.exposed_s == pytest.approx(2 * (gather_s - fusion_s) + reduce_s)
  assert comm.replayed_compute_s == pytest.approx(2 * fusion_s + 1e-6)
  assert not comm.unknown_trips
  # Fully hidden when the fusion outlasts the gather.
  hidden = ici.communication(
    PROGRAM, devices, {"fusion.1": 2 * gather_s}, {"fusion.1": 2.0}
  ).collectives
  assert {c.name: c for c in hidden}["all-gather-start"].exposed_s == 0.0


needs_tpu = pytest.mark.skipif(
  not targets.packages_dir("tpu").is_dir() and not os.environ.get("IHA_REQUIRE_TARGETS"),
  reason="libtpu missing: `make targets` (make test installs it)",
)


@needs_tpu
def test_libtpus_ring_collectives_match_the_arithmetic(tmp_path):
  """An all-gather, a reduce-scatter (libtpu's fused all-reduce + slice) and an all-reduce
  over a v5p-128 x ring, read from the compiled programs: within 1% of (n-1)/n V / 2W."""
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  out = tmp_path / "ici.json"
  proc = subprocess.run(
    [sys.executable, "benchmarks/ici_calibration.py", "--mib", "16", "--json", str(out)],
    capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r["collective"] for r in rows] == ["all-gather", "reduce-scatter", "all-reduce"]
  assert all(r["within"] and "x ring 4" in r["group"] for r in rows), rows
  assert np.isclose(rows[0]["bytes_per_chip"], 16 * 2**20)
