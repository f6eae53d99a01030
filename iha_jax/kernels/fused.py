"""Fused IHA / MHA attention: layouts, custom VJP and platform dispatch.

`iha_attention` feeds the SOURCE heads `[B, N, H, d]` and the `[H, H, P]` mixing
tensors to the Pallas kernels, which build every pseudo q/k/v tile on chip.
Attention is causal or bidirectional (`causal=False`), global or windowed, with
the mask of `iha_jax.ops.masking.visible`; `mha_attention`'s v may be wider than
q and k (`[B, N, H, dv]`, e.g. dv = 2d for differential attention).
What IHA's custom VJP (attention + collapse) saves for the backward:
  q, k, v (source, `[B, H, Np, W]`), alpha_* (flat float32), collapse, segment
  ids and positions (`[B, Np]` int32) and the float32 log-sum-exp
  `[B, H, P, Np, 1]` (1/W of the output's elements).
Nothing P-sized is saved: the de-interleaved output o `[B, H, P, Np, W]` (P times
the MHA output) is recomputed in the backward by one more forward kernel, where it
gives d(collapse) and the FlashAttention-2 `delta = rowsum(o * do)`. That trades
one forward pass for P x less saved activation (see WORKSPACE_NOTES.md). No
`[B, N*P, H, d]` pseudo q/k/v exists in the forward or the backward: the backward
kernels recompute pseudo tiles and contract their gradients with alpha on chip.
MHA (P = 1) saves its output, as any flash attention does.

Where the kernels run: `lax.platform_dependent` picks the compiled kernel when
lowering for its platform (TPU: Mosaic; cuda/rocm: Triton) and the same kernel
in Pallas interpret mode for any other platform (e.g. CPU), so
`implementation="pallas_gpu"` works everywhere, and `jax.export` for "tpu" or
"cuda" from a CPU host emits the real kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from iha_jax.kernels import gpu, tpu
from iha_jax.kernels.common import Config
from iha_jax.ops.options import BlockSizes
from iha_jax.ops.rope import rope_frequencies

_BACKENDS = {"gpu": gpu, "tpu": tpu}


def _run(platform: str, name: str, cfg: Config, *args):
  """Calls `backend.<name>(cfg, *args)`, compiled on its platform, interpreted elsewhere."""
  fn = getattr(_BACKENDS[platform], name)
  compiled = functools.partial(fn, cfg, interpret=False)
  # Pallas' HLO interpreter: effect-free, so the compiled branch still lowers (and
  # exports) alongside it. Tests add Mosaic semantics with pltpu.force_tpu_interpret_mode.
  interpreted = functools.partial(fn, cfg, interpret=True)
  targets = {"tpu": compiled} if platform == "tpu" else {"cuda": compiled, "rocm": compiled}
  return lax.platform_dependent(*args, default=interpreted, **targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(platform, cfg, alphas, inv_freq, seg, pos, q, k, v):
  return _attend_fwd(platform, cfg, alphas, inv_freq, seg, pos, q, k, v)[0]


def _attend_fwd(platform, cfg, alphas, inv_freq, seg, pos, q, k, v):
  o, lse = _run(platform, "forward", cfg, alphas, inv_freq, seg, pos, q, k, v)
  return o, (alphas, inv_freq, seg, pos, q, k, v, o, lse)


def _attend_bwd(platform, cfg, residuals, do, delta=None):
  alphas, inv_freq, seg, pos, q, k, v, o, lse = residuals
  if delta is None:
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
  dq, dk, dv, dalpha = _run(
    platform, "backward", cfg, alphas, inv_freq, seg, pos, q, k, v, do.astype(q.dtype), lse, delta
  )
  # Per-(batch, tile) partial dalpha -> the flat alpha layout.
  dalphas = tuple(x.reshape(-1, x.shape[-1]).sum(axis=0) for x in dalpha) if cfg.mixing else ()
  return (dalphas, None, None, None, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


_attend.defvjp(_attend_fwd, _attend_bwd)


def _collapse_spec(collapse: jax.Array) -> str:
  return "bgpnd,hgp->bnhd" if collapse.ndim == 3 else "bhpnd,hp->bnhd"


def collapse_outputs(o: jax.Array, collapse: jax.Array) -> jax.Array:
  """docs/design.md §1.6 on the kernel layout: `[B, Ht, P, Np, W]` -> `[B, Np, H, W]` float32."""
  return jnp.einsum(
    _collapse_spec(collapse), o, collapse.astype(o.dtype), preferred_element_type=jnp.float32
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend_collapse(platform, cfg, alphas, inv_freq, seg, pos, q, k, v, collapse):
  """Fused attention, then collapse: `[B, Np, H', W]` float32 (H' = H full, Ht per_head)."""
  o, _ = _run(platform, "forward", cfg, alphas, inv_freq, seg, pos, q, k, v)
  return collapse_outputs(o, collapse)


def _attend_collapse_fwd(platform, cfg, alphas, inv_freq, seg, pos, q, k, v, collapse):
  o, lse = _run(platform, "forward", cfg, alphas, inv_freq, seg, pos, q, k, v)
  # o is dropped here: the backward recomputes it (the only P-sized activation).
  return collapse_outputs(o, collapse), (alphas, inv_freq, seg, pos, q, k, v, collapse, lse)


def _attend_collapse_bwd(platform, cfg, residuals, dy):
  alphas, inv_freq, seg, pos, q, k, v, collapse, lse = residuals
  o, _ = _run(platform, "forward", cfg, alphas, inv_freq, seg, pos, q, k, v)
  inputs, output = _collapse_spec(collapse).split("->")
  o_spec, c_spec = inputs.split(",")
  d_collapse = jnp.einsum(f"{output},{o_spec}->{c_spec}", dy, o, preferred_element_type=jnp.float32)
  do = jnp.einsum(
    f"{output},{c_spec}->{o_spec}",
    dy,
    collapse.astype(jnp.float32),
    preferred_element_type=jnp.float32,
  )
  delta = jnp.sum(o.astype(jnp.float32) * do, axis=-1, keepdims=True)
  grads = _attend_bwd(platform, cfg, (alphas, inv_freq, seg, pos, q, k, v, o, lse), do, delta=delta)
  return (*grads, d_collapse.astype(collapse.dtype))


_attend_collapse.defvjp(_attend_collapse_fwd, _attend_collapse_bwd)


def _split_point(d: int) -> int:
  return (d + 1) // 2  # rotate-half pairs lane e < d/2 with lane e + d/2


def _to_kernel(x: jax.Array, half: int, seq_len: int) -> jax.Array:
  """`[B, N, H, d]` -> `[B, H, Np, 2 * half]`: each lane half padded to `half`, tokens to Np."""
  n, d = x.shape[1], x.shape[3]
  s = _split_point(d)
  pad = lambda y: jnp.pad(y, ((0, 0), (0, seq_len - n), (0, 0), (0, half - y.shape[-1])))
  return jnp.swapaxes(jnp.concatenate([pad(x[..., :s]), pad(x[..., s:])], axis=-1), 1, 2)


def _from_kernel(y: jax.Array, n: int, d: int, half: int) -> jax.Array:
  """`[B, Np, H, 2 * half]` -> `[B, N, H, d]`: drops token and lane padding."""
  s = _split_point(d)
  return jnp.concatenate([y[:, :n, :, :s], y[:, :n, :, half : half + d - s]], axis=-1)


def _tiles(
  platform: str, n: int, num_pseudo: int, dtype, block_sizes: BlockSizes | None
) -> tuple[int, int, int]:
  """(block_q, block_k, Np) in tokens from BlockSizes in virtual tokens (multiples of P)."""
  blocks = []
  for name in ("block_q", "block_k"):
    value = getattr(block_sizes, name, None) if block_sizes is not None else None
    if value is not None and value % num_pseudo:
      raise ValueError(
        f"{name} = {value} virtual tokens must be a multiple of P = "
        f"{num_pseudo} for the fused kernels (a tile holds whole tokens)."
      )
    blocks.append(None if value is None else value // num_pseudo)
  return _BACKENDS[platform].tiles(n, num_pseudo, jnp.dtype(dtype), *blocks)


def _config(
  platform: str,
  q: jax.Array,
  v: jax.Array,
  num_targets: int,
  num_pseudo: int,
  mixing: bool,
  window: int | None,
  rope_theta: float | None,
  causal: bool,
  block_sizes: BlockSizes | None,
) -> Config:
  _, n, h, d = q.shape
  block_q, block_k, seq_len = _tiles(platform, n, num_pseudo, q.dtype, block_sizes)
  half_width = _BACKENDS[platform].half_width
  return Config(
    num_heads=h,
    num_targets=num_targets,
    num_pseudo=num_pseudo,
    mixing=mixing,
    head_dim=d,
    half=half_width(d),
    value_half=half_width(v.shape[3]),
    block_q=block_q,
    block_k=block_k,
    seq_len=seq_len,
    window=window,
    rope=rope_theta is not None,
    causal=causal,
  )


def _prepare(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array] | None,
  *,
  window: int | None,
  segment_ids: jax.Array | None,
  positions: jax.Array,
  rope_theta: float | None,
  causal: bool,
  platform: str,
  block_sizes: BlockSizes | None,
):
  """Kernel config and kernel-layout inputs, plus `restore` back to `[B, N, H', dv]`."""
  b, n, _, d = q.shape
  num_targets, num_pseudo = (q.shape[2], 1) if alphas is None else alphas[0].shape[1:]
  cfg = _config(
    platform,
    q,
    v,
    num_targets,
    num_pseudo,
    alphas is not None,
    window,
    rope_theta,
    causal,
    block_sizes,
  )
  # Flat (target h, source m, pseudo p) order: one scalar read per coefficient.
  flat = (
    ()
    if alphas is None
    else tuple(jnp.swapaxes(a, 0, 1).reshape(-1).astype(jnp.float32) for a in alphas)
  )
  freq = jnp.zeros((1, cfg.half), jnp.float32)
  if rope_theta is not None:
    freq = freq.at[0, : d // 2].set(rope_frequencies(d, rope_theta))
  if segment_ids is None:  # one unpadded sequence per row
    segment_ids = jnp.ones((b, n), jnp.int32)
  pad = lambda x: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, cfg.seq_len - n)))
  args = (
    flat,
    freq,
    pad(segment_ids),
    pad(positions),
    _to_kernel(q, cfg.half, cfg.seq_len),
    _to_kernel(k, cfg.half, cfg.seq_len),
    _to_kernel(v, cfg.value_half, cfg.seq_len),
  )
  return cfg, args, functools.partial(_from_kernel, n=n, d=v.shape[3], half=cfg.value_half)


def pseudo_outputs(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array] | None,
  *,
  window: int | None,
  segment_ids: jax.Array | None,
  positions: jax.Array,
  rope_theta: float | None,
  platform: str,
  block_sizes: BlockSizes | None,
  causal: bool = True,
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """Fused attention over the virtual sequence, de-interleaved, in the kernel layout.

  q, k `[B, N, H, d]`; v `[B, N, H, dv]` (dv = d for IHA; MHA may use a wider v).
  `alphas = (alpha_q, alpha_k, alpha_v)` `[H, Ht, P]` (all H source heads of q, k, v
  feed the Ht target heads computed here: Ht = H, or a head shard), or None for
  plain MHA (Ht = H, P = 1). `segment_ids` None: one unpadded sequence per row.
  `causal=False` attends bidirectionally (`ops.masking.visible`).

  Returns `(o, restore)`: o `[B, Ht, P, Np, Wv]` (padded tokens and lanes) and
  `restore`, mapping a collapsed `[B, Np, H', Wv]` to `[B, N, H', dv]`. The VJP saves
  o; IHA layers use `collapsed_outputs`, which saves nothing P-sized.
  """
  cfg, args, restore = _prepare(
    q,
    k,
    v,
    alphas,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    causal=causal,
    platform=platform,
    block_sizes=block_sizes,
  )
  return _attend(platform, cfg, *args), restore


def collapsed_outputs(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  *,
  window: int | None,
  segment_ids: jax.Array | None,
  positions: jax.Array,
  rope_theta: float | None,
  platform: str,
  block_sizes: BlockSizes | None,
  causal: bool = True,
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """Fused attention and collapse of the local target heads (see `pseudo_outputs`).

  Returns `(y, restore)`: y `[B, Np, H', Wv]` float32 (H' = H for a full `[H, Ht, P]`
  collapse: a partial sum over the local target heads; H' = Ht for per_head `[Ht, P]`).
  """
  cfg, args, restore = _prepare(
    q,
    k,
    v,
    alphas,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    causal=causal,
    platform=platform,
    block_sizes=block_sizes,
  )
  return _attend_collapse(platform, cfg, *args, collapse), restore


def iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  *,
  window: int | None,
  segment_ids: jax.Array | None,
  positions: jax.Array,
  rope_theta: float | None,
  platform: str,
  block_sizes: BlockSizes | None,
  causal: bool = True,
) -> jax.Array:
  """Fused IHA core (docs/design.md §1.2-1.6) on source heads `[B, N, H, d]` -> `[B, N, H, d]`.

  Mixing, RoPE at virtual positions and attention (causal, or bidirectional with
  `causal=False`) run in the kernels; the collapse is an einsum on the kernel's
  de-interleaved output `[B, H, P, Np, W]`, inside the custom VJP so that output is
  recomputed, not saved, for backward. `segment_ids` None: one sequence per row.
  """
  y, restore = collapsed_outputs(
    q,
    k,
    v,
    (alpha_q, alpha_k, alpha_v),
    collapse,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    platform=platform,
    block_sizes=block_sizes,
    causal=causal,
  )
  return restore(y).astype(q.dtype)


def mha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  window: int | None,
  segment_ids: jax.Array | None,
  positions: jax.Array,
  rope_theta: float | None,
  platform: str,
  block_sizes: BlockSizes | None,
  causal: bool = True,
) -> jax.Array:
  """MHA (causal or bidirectional) through the same kernels without mixing (P = 1).

  q, k `[B, N, H, d]` (RoPE applies to these), v `[B, N, H, dv]` (dv may differ from d,
  e.g. 2d for differential attention) -> `[B, N, H, dv]`.
  """
  o, restore = pseudo_outputs(
    q,
    k,
    v,
    None,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    platform=platform,
    block_sizes=block_sizes,
    causal=causal,
  )
  return restore(jnp.swapaxes(o[:, :, 0], 1, 2))
