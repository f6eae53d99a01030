"""benchmarks/ptx_inner_loop.py's PTX parsing on a hand-written kernel: statements (inline
asm puts several on a line), loops (a label and a later branch back to it), the innermost
and main loops, and exact per-category counts. Text only: nothing compiles."""

from __future__ import annotations

from benchmarks import ptx_inner_loop as pil

# An outer loop ($L__BB0_1) holding a key loop ($L__BB0_2, the wgmma one), then a second
# innermost loop ($L__BB0_4) with no tensor cores; $L__BB0_3 is a forward branch only.
PTX = """\
.version 8.4
.target sm_90a
.address_size 64

.visible .entry toy_kernel(
\t.param .u64 toy_kernel_param_0
)
.reqntid 128, 1, 1
{
\t.reg .b32 \t%r<100>;
\tmov.u32 \t%r1, 0;
$L__BB0_1:
\t// begin inline asm
\tmov.u32 %r2, 0x0; mov.u32 %r3, 0x0; ld.global.v2.b32 { %r2, %r3 }, [ %rd1 + 0 ];
\t// end inline asm
$L__BB0_2:
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r4,%r5}, %rd2, %rd3, p, 1, 1, 0, 1;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r4,%r5}, %rd2, %rd3, p, 1, 1, 0, 1;
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 0;
\tfma.rn.f32 \t%r6, %r4, %r5, %r6;
\tmul.rn.f32 \t%r7, %r6, 0f3E000000;
\tsub.f32 \t%r8, %r7, %r6;
\tex2.approx.ftz.f32 \t%r9, %r8;
\t@%p1 ld.global.b32 { %r10 }, [ %rd4 + 0 ];
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r11, %r12, %r13, %r14}, [%r15];
\t@%p2 bra \t$L__BB0_2;
\tsetp.ne.s32 \t%p3, %r1, 8;
\t@%p3 bra \t$L__BB0_3;
\tst.shared.v4.b32 \t[%r16], {%r11, %r12, %r13, %r14};
$L__BB0_3:
\tadd.s32 \t%r1, %r1, 1;
\t@%p4 bra \t$L__BB0_1;
$L__BB0_4:
\tcp.async.cg.shared.global [ %r17 + 0 ], [ %rd5 + 0 ], 0x10, %r18;
\tcp.async.commit_group;
\tfma.rn.bf16x2 \t%r19, %r20, %r21, %r22;
\tadd.rn.f32 \t%r23, %r23, %r24;
\tbra.uni \t$L__BB0_4;
\tret;

}
"""


def _lines() -> list[str]:
  return PTX.splitlines()


def test_statements_split_inline_asm_and_skip_directives():
  line = "\tmov.u32 %r2, 0x0; ld.global.v2.b32 { %r2, %r3 }, [ %rd1 + 0 ]; // note"
  assert pil.statements(line) == ["mov.u32 %r2, 0x0", "ld.global.v2.b32 { %r2, %r3 }, [ %rd1 + 0 ]"]
  assert pil.statements("\t.reg .b32 \t%r<100>;") == []
  assert pil.statements("$L__BB0_1:") == []
  assert pil.statements("{") == [] and pil.statements("}") == []
  assert pil.opcode("@%p1 ld.global.b32 { %r10 }, [ %rd4 + 0 ]") == "ld.global.b32"
  assert pil.opcode("@!%p1 bra $L__BB0_2") == "bra"


def test_categories():
  expected = {
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": "wgmma",
    "wgmma.fence.sync.aligned": "wgmma_sync",
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": "mma_sync",
    "fma.rn.f32": "fma_f32",
    "mul.f32": "mul_f32",
    "add.rn.ftz.f32": "add_f32",
    "sub.f32": "add_f32",
    "fma.rn.bf16x2": "packed_f16",
    "ex2.approx.ftz.f32": "ex2",
    "ld.global.nc.v4.b32": "ld_global",
    "ld.shared.b32": "ld_shared",
    "stmatrix.sync.aligned.m8n8.x4.shared.b16": "st_shared",
    "cp.async.bulk.tensor.2d.shared::cluster.global": "cp_async",
    "cp.async.wait_group": None,
    "mul.wide.u32": None,
    "add.s32": None,
    "max.f32": None,
  }
  assert {op: pil.category(op) for op in expected} == expected


def test_entries_and_loops():
  first, last = pil.entries(PTX)["toy_kernel"]
  assert (first, last) == (9, 42)  # 0-based: after the `{` line, to the closing `}`
  loops = pil.find_loops(_lines(), first, last)
  spans = [(loop.label, loop.start, loop.end) for loop in loops]
  assert spans == [("$L__BB0_1", 12, 34), ("$L__BB0_2", 16, 28), ("$L__BB0_4", 35, 40)]
  outer, key, tail = loops
  assert outer.contains(key) and not key.contains(outer) and not outer.contains(tail)


def test_rows_innermost_main_and_whole_kernel():
  first, last = pil.entries(PTX)["toy_kernel"]
  rows = pil.loop_rows("toy_kernel", _lines(), first, last)
  assert [(r["loop"], r["lines"]) for r in rows] == [
    ("main $L__BB0_2", "16-28"),
    ("inner $L__BB0_4", "35-40"),
    ("whole kernel", "10-43"),
  ]
  main, tail, whole = rows
  assert {k: main[k] for k in ("wgmma", "wgmma_sync", "mma_sync", "ex2", "total")} == {
    "wgmma": 2,
    "wgmma_sync": 3,
    "mma_sync": 0,
    "ex2": 1,
    "total": 12,
  }
  assert (main["fma_f32"], main["mul_f32"], main["add_f32"], main["packed_f16"]) == (1, 1, 1, 0)
  assert (main["ld_global"], main["ld_shared"], main["st_shared"], main["cp_async"]) == (1, 1, 0, 0)
  assert main["mma_shapes"] == {"m64n128k16": 1, "m64n64k16": 1}
  assert (tail["cp_async"], tail["packed_f16"], tail["add_f32"], tail["total"]) == (1, 1, 1, 5)
  assert tail["mma_shapes"] == {}
  # Whole kernel: a mov, the inline-asm line's 3, the key loop, 5 after it, the tail
  # loop, ret.
  assert whole["total"] == 1 + 3 + 12 + 5 + 5 + 1
  assert (whole["ld_global"], whole["st_shared"], whole["wgmma"], whole["bar"]) == (2, 1, 2, 0)


def test_outer_loop_listed_when_it_holds_the_tensor_cores():
  # Move the wgmmas out of the key loop into the outer one: the outer loop becomes "main".
  lines = _lines()
  wgmma = [line for line in lines if "wgmma.mma_async" in line]
  lines = [line for line in lines if "wgmma.mma_async" not in line]
  lines[lines.index("$L__BB0_3:") : lines.index("$L__BB0_3:")] = wgmma
  first, last = pil.entries("\n".join(lines))["toy_kernel"]
  loops = [r["loop"] for r in pil.loop_rows("toy_kernel", lines, first, last)]
  assert loops == [
    "main $L__BB0_1 (holds 1 loop)",
    "inner $L__BB0_2",
    "inner $L__BB0_4",
    "whole kernel",
  ]
