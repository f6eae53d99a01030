"""Compiles the Pallas attention kernels for a target (TPU or H100) without its hardware.

The shared harness of `compile_matrix.py`, `ptx_inner_loop.py` and the compile tests:
a `Case` is one kernel configuration a layer can produce (kind, heads, P, d, tokens,
mask, dtype, forward or forward+backward); `compile_case` lowers it through the public
kernel entry points (`iha_jax.kernels`) on one compile-only device of the target and
compiles it with the target's own compiler, returning its static report
(`iha_jax.parallel.compiled`). Compiled, not run: nothing here measures speed.

Call `iha_jax.parallel.targets.use_compile_packages(platform)` (or `devices`) before any
other JAX call in the process.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from iha_jax import kernels
from iha_jax.core.options import AttentionOptions, BlockSizes
from iha_jax.kernels.window import gpu as gpu_window
from iha_jax.kernels.window import tpu as tpu_window
from iha_jax.parallel import compiled, context, targets


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel configuration (`kind` "iha", or "mha": P = 1 without mixing; differential
  attention is MHA with `value_dim = 2 * head_dim`; `kv_heads` G < H is grouped-query;
  `shards` > 1: one sequence shard's call under context parallelism, `tokens / shards`
  queries at a traced query offset against every key (global) or the shard and its
  window halo)."""

  kind: str = "iha"
  heads: int = 8
  kv_heads: int | None = None  # G key/value heads; None = heads
  num_pseudo: int = 2
  head_dim: int = 128
  value_dim: int | None = None  # MHA only; None = head_dim
  tokens: int = 4096
  window: int | None = None  # virtual tokens (tokens for MHA)
  causal: bool = True
  segments: bool = False  # packed segment ids given
  dtype: str = "bfloat16"
  backward: bool = True  # forward+backward (else forward only)
  collapse: str = "full"  # or "per_head"
  blocks: tuple[int, int] | None = None  # BlockSizes (virtual tokens); None: the defaults
  shards: int = 1  # context shards (> 1: a sliced call with a traced offset)
  onchip: bool = False  # IHA's on-chip window path (TPU or GPU; a shard's offset is static)

  @property
  def key_tokens(self) -> int:
    """Keys of the call: all tokens, or a shard's own and its halo (one side if causal)."""
    if self.shards == 1:
      return self.tokens
    reach = context.reach_tokens(self.window, self.num_pseudo if self.kind == "iha" else 1)
    local = self.tokens // self.shards
    if reach is None or reach >= local:
      return self.tokens
    return local + reach * (1 if self.causal else 2)

  @property
  def label(self) -> str:
    reach = f"w{self.window}" if self.window else "global"
    mask = f"{'causal' if self.causal else 'bidir'}/{reach}"
    p = (
      f"P={self.num_pseudo}"
      if self.kind == "iha"
      else "MHA" + (f" dv={self.value_dim}" if self.value_dim else "")
    )
    blocks = f" blocks={self.blocks[0]}x{self.blocks[1]}" if self.blocks else ""
    blocks += " on-chip" if self.onchip else ""
    groups = f" G={self.kv_heads}" if self.kv_heads not in (None, self.heads) else ""
    tokens = f"N={self.tokens}"
    if self.shards > 1:
      tokens = f"N={self.tokens // self.shards} of {self.tokens} (keys {self.key_tokens})"
    return (
      f"{p} H={self.heads}{groups} d={self.head_dim} {tokens} {mask}"
      f"{' seg' if self.segments else ''} {self.dtype} {'fwd+bwd' if self.backward else 'fwd'}"
      f"{blocks}"
    )


@dataclasses.dataclass(frozen=True)
class Result:
  case: Case
  ok: bool
  error: str  # first line of the compiler's error ("" when it compiled)
  seconds: float
  report: compiled.Report | None


def _inputs(case: Case, device: jax.Device) -> tuple[jax.ShapeDtypeStruct, ...]:
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  dtype = jnp.dtype(case.dtype)
  b, n, h, d = 1, case.tokens // case.shards, case.heads, case.head_dim
  g, nk = case.kv_heads or h, case.key_tokens
  q, k = spec((b, n, h, d), dtype), spec((b, nk, g, d), dtype)
  tokens = (spec((b, n), jnp.int32),) * 2
  if case.shards > 1:  # key ids and positions, the query offset (traced unless on-chip)
    tokens += (spec((b, nk), jnp.int32),) * 2
    tokens += () if case.onchip else (spec((), jnp.int32),)
  if case.kind == "mha":
    return q, k, spec((b, nk, g, case.value_dim or d), dtype), *tokens
  alpha_q, alpha_kv = (spec((x, x, case.num_pseudo), jnp.float32) for x in (h, g))
  collapse = spec(
    (h, case.num_pseudo) if case.collapse == "per_head" else (h, h, case.num_pseudo), jnp.float32
  )
  return q, k, k, alpha_q, alpha_kv, alpha_kv, collapse, *tokens


def kernels_block_sizes(blocks: tuple[int, int] | None) -> BlockSizes | None:
  return None if blocks is None else BlockSizes(*blocks)


def _function(case: Case, platform: str):
  blocks = kernels_block_sizes(case.blocks)
  options = AttentionOptions(
    window=case.window, rope_theta=10000.0, causal=case.causal, block_sizes=blocks
  )

  def attend(*args):
    sliced = {}
    if case.shards > 1:
      if case.onchip:  # a window layer's shard: its halo before it, a static offset
        *args, kv_segment_ids, kv_positions = args
        offset = case.key_tokens - case.tokens // case.shards
      else:
        *args, kv_segment_ids, kv_positions, offset = args
      sliced = dict(kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, query_offset=offset)
    *arrays, segment_ids, positions = args
    entry = kernels.pallas_mha if case.kind == "mha" else _materialised
    if case.onchip:
      entry = _onchip
    call_options = options.replace(
      segment_ids=segment_ids if case.segments else None, positions=positions, **sliced
    )
    out = entry(*arrays, call_options, platform=platform)
    return jnp.sum(out.astype(jnp.float32))

  if not case.backward:
    return attend
  differentiable = 3 if case.kind == "mha" else 7
  # The value too: a backward that needs no forward residual (the on-chip path's) would
  # otherwise leave the forward kernel out of the program.
  return jax.value_and_grad(attend, argnums=tuple(range(differentiable)))


def _materialised(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options, *, platform: str):
  alphas = (alpha_q, alpha_k, alpha_v)
  return kernels.pallas_iha(q, k, v, alphas, collapse, options, platform=platform).astype(q.dtype)


def _onchip(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options, *, platform: str):
  path = gpu_window if platform == "gpu" else tpu_window
  return path.window_iha(q, k, v, (alpha_q, alpha_k, alpha_v), collapse, options)


def compile_case(case: Case, target: targets.Target, device: jax.Device) -> Result:
  """Lowers and compiles `case` for `target` on `device` (one of `targets.devices`)."""
  start = time.perf_counter()
  try:
    with targets.lowering_for(target.platform):  # Triton's GPU named (jax 0.11+)
      lowered = jax.jit(_function(case, target.kernel_platform)).lower(*_inputs(case, device))
    _, report = compiled.compile_with_report(lowered)
  except Exception as error:  # a compiler rejection is this harness's result, not a crash
    lines = [line for line in str(error).splitlines() if line.strip()]
    message = next(
      (line for line in lines if "vmem" in line.lower() or "memory" in line.lower()),
      lines[0] if lines else type(error).__name__,
    )
    return Result(case, False, message[:300], time.perf_counter() - start, None)
  return Result(case, True, "", time.perf_counter() - start, report)
