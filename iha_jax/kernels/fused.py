"""Fused IHA / MHA attention: layouts, custom VJP and platform dispatch.

On GPU, `fused_iha_attention` feeds the SOURCE heads (q `[B, N, H, d]`, k and v
`[B, N, G, d]`) and the mixing tensors (`alpha_q: [H, H, P]`, `alpha_k, alpha_v:
[G, G, P]`) to the Pallas Triton kernels, which build every pseudo q/k/v tile on chip; G <
H is grouped-query attention (query head h reads key/value head `h // (H // G)`; keys and
values stay G heads in HBM, `iha_jax.kernels.common`). On TPU the entry points hand over
to `iha_jax.kernels.tpu_attention` (pseudo-heads mixed in HBM, then Mosaic flash
attention); everything below about layouts and residuals is the GPU path's.
Attention is causal or bidirectional (`causal=False`), global or windowed, with
the mask of `iha_jax.core.masking.visible`; `fused_mha_attention`'s v may be wider than
q and k (`[B, N, G, dv]`, e.g. dv = 2d for differential attention). RoPE at virtual
position `pos * P + p` is split as `R(p) R(pos * P)`: q and k are rotated by
`R(pos * P)` here, the kernels apply `R(p)` (`iha_jax.kernels.common`).
Sequence shards (`AttentionOptions.sliced`, as `iha_jax.parallel.context` calls it): k and
v may hold `Nk != N` tokens with their own `kv_segment_ids` and `kv_positions` (keys
rotate at their own positions), and `query_offset` (an int or a traced int32 scalar)
places the queries on the keys' sequence; it reaches the kernels as a `[1]` int32
operand (TPU: scalar prefetch), so every shard runs one compiled kernel. Unsliced calls
take none of this (their programs are unchanged).
What IHA's custom VJP (attention + collapse) saves for the backward:
  q, k (rotated), v (source, `[B, H or G, Np, W]`), alpha_* (flat float32), the `[P, half]`
  rotation tables, collapse, segment ids (`[B, Np]` int32; sliced: the offset and the
  keys' `[B, Nkp]` too) and the float32 log-sum-exp
  (1/W of the pseudo output's elements).
Nothing P-sized is saved: the pseudo output o (`backend.OUTPUT_SPEC`, P times the MHA
output) is recomputed in the backward by one more forward kernel, where it gives
d(collapse) and the FlashAttention-2 `delta = rowsum(o * do)`; o and its cotangent pass
through HBM there (docs/compile_checks.md). No pseudo q/k/v exists in the forward or the
backward: the backward kernels recompute pseudo tiles and contract their gradients with
alpha on chip. MHA (P = 1) saves its output, as any flash attention does.

Where the kernels run: `lax.platform_dependent` picks the compiled kernel when
lowering for its platform (TPU: Mosaic; cuda/rocm: Triton) and the same kernel
in Pallas interpret mode for any other platform (e.g. CPU), so
`implementation="pallas_gpu"` works everywhere, and `jax.export` or a compile-only
device (`iha_jax.parallel.targets`) for "tpu" or "cuda" gets the real kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from iha_jax.core.options import AttentionOptions
from iha_jax.core.rope import apply_rope, rope_frequencies
from iha_jax.core.validation import default_positions
from iha_jax.kernels import gpu, tpu_attention
from iha_jax.kernels.common import Config

_BACKENDS = {"gpu": gpu}  # TPU: iha_jax.kernels.tpu_attention (pseudo-heads mixed in HBM)


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
def _attend(platform, cfg, alphas, rotation, seg, q, k, v):
  return _attend_fwd(platform, cfg, alphas, rotation, seg, q, k, v)[0]


def _attend_fwd(platform, cfg, alphas, rotation, seg, q, k, v):
  o, lse = _run(platform, "forward", cfg, alphas, rotation, seg, q, k, v)
  return o, (alphas, rotation, seg, q, k, v, o, lse)


def _attend_bwd(platform, cfg, residuals, do, delta=None):
  alphas, rotation, seg, q, k, v, o, lse = residuals
  if delta is None:
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
  backend = _BACKENDS[platform]
  dq, dk, dv, dalpha = _run(
    platform, "backward", cfg, alphas, rotation, seg, q, k, v, do.astype(q.dtype), lse, delta
  )
  # Per-(batch, tile) partial dalpha -> the flat alpha layouts (alpha_q's, then k's and v's).
  dalphas = (
    tuple(backend.dalpha_flat(x, cfg, kv=i > 0) for i, x in enumerate(dalpha)) if cfg.mixing else ()
  )
  return (dalphas, None, None, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


_attend.defvjp(_attend_fwd, _attend_bwd)


def _collapse_spec(platform: str, collapse: jax.Array) -> str:
  """einsum of the pseudo view (`backend.OUTPUT_SPEC`: b, target h, p, n, d) and collapse."""
  o_spec = _BACKENDS[platform].OUTPUT_SPEC
  if collapse.ndim == 3:  # full: every output head h reads every target head g
    return f"{o_spec.replace('h', 'g')},hgp->bnhd"
  return f"{o_spec},hp->bnhd"


def collapse_outputs(platform: str, cfg: Config, o: jax.Array, collapse: jax.Array) -> jax.Array:
  """docs/design.md §1.6 on the kernel layout: pseudo outputs -> `[B, Np, H', W]` float32."""
  backend = _BACKENDS[platform]
  weights = backend.collapse_weights(collapse, cfg).astype(o.dtype)
  return jnp.einsum(
    _collapse_spec(platform, collapse),
    backend.pseudo_view(o, cfg),
    weights,
    preferred_element_type=jnp.float32,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend_collapse(platform, cfg, alphas, rotation, seg, q, k, v, collapse):
  """Fused attention, then collapse: `[B, Np, H', W]` float32 (H' = H full, Ht per_head)."""
  o, _ = _run(platform, "forward", cfg, alphas, rotation, seg, q, k, v)
  return collapse_outputs(platform, cfg, o, collapse)


def _attend_collapse_fwd(platform, cfg, alphas, rotation, seg, q, k, v, collapse):
  o, lse = _run(platform, "forward", cfg, alphas, rotation, seg, q, k, v)
  # o is dropped here: the backward recomputes it (the only P-sized activation).
  out = collapse_outputs(platform, cfg, o, collapse)
  return out, (alphas, rotation, seg, q, k, v, collapse, lse)


def _attend_collapse_bwd(platform, cfg, residuals, dy):
  alphas, rotation, seg, q, k, v, collapse, lse = residuals
  backend = _BACKENDS[platform]
  o, _ = _run(platform, "forward", cfg, alphas, rotation, seg, q, k, v)
  inputs, output = _collapse_spec(platform, collapse).split("->")
  o_spec, c_spec = inputs.split(",")
  weights = backend.collapse_weights(collapse, cfg).astype(jnp.float32)
  o5 = backend.pseudo_view(o, cfg)
  d_weights = jnp.einsum(f"{output},{o_spec}->{c_spec}", dy, o5, preferred_element_type=jnp.float32)
  do = jnp.einsum(f"{output},{c_spec}->{o_spec}", dy, weights, preferred_element_type=jnp.float32)
  delta = jnp.sum(o5.astype(jnp.float32) * do, axis=-1, keepdims=True)
  grads = _attend_bwd(
    platform,
    cfg,
    (alphas, rotation, seg, q, k, v, o, lse),
    backend.kernel_view(do, cfg),
    delta=backend.kernel_view(delta, cfg),
  )
  d_collapse = d_weights[..., : collapse.shape[-1]]  # drop the tile's dead pseudo rows
  return (*grads, d_collapse.astype(collapse.dtype))


_attend_collapse.defvjp(_attend_collapse_fwd, _attend_collapse_bwd)


def _split_point(d: int) -> int:
  return (d + 1) // 2  # rotate-half pairs lane e < d/2 with lane e + d/2


def _to_kernel(x: jax.Array, half: int, seq_len: int) -> jax.Array:
  """`[B, N, H, d]` -> `[B, H, Np, 2 * half]` (any head count): each lane half padded to
  `half`, tokens to Np."""
  n, d = x.shape[1], x.shape[3]
  s = _split_point(d)
  pad = lambda y: jnp.pad(y, ((0, 0), (0, seq_len - n), (0, 0), (0, half - y.shape[-1])))
  return jnp.swapaxes(jnp.concatenate([pad(x[..., :s]), pad(x[..., s:])], axis=-1), 1, 2)


def _from_kernel(y: jax.Array, n: int, d: int, half: int) -> jax.Array:
  """`[B, Np, H, 2 * half]` -> `[B, N, H, d]`: drops token and lane padding."""
  s = _split_point(d)
  return jnp.concatenate([y[:, :n, :, :s], y[:, :n, :, half : half + d - s]], axis=-1)


def _config(
  platform: str,
  q: jax.Array,
  v: jax.Array,
  targets: tuple[int, int],
  num_pseudo: int,
  mixing: bool,
  options: AttentionOptions,
  sliced: bool,
) -> Config:
  """`targets`: (query, key/value) target heads computed here; `sliced`: queries that are
  a slice of the keys' sequence (v's tokens)."""
  _, n, h, d = q.shape
  offset = options.query_offset
  backend = _BACKENDS[platform]
  shape = Config(
    num_heads=h,
    num_kv_heads=v.shape[2],
    num_targets=targets[0],
    kv_targets=targets[1],
    num_pseudo=num_pseudo,
    mixing=mixing,
    head_dim=d,
    half=backend.half_width(d),
    value_half=backend.half_width(v.shape[3]),
    block_q=0,
    block_k=0,
    seq_len=0,
    window=options.window,
    rope=options.rope_theta is not None and num_pseudo > 1,  # R(0) is the identity
    causal=options.causal,
    sliced=sliced,
    # A Python int fixes the TPU band width; a traced offset needs the widest.
    static_offset=offset if isinstance(offset, int) else None,
  )
  blocks = [getattr(options.block_sizes, name, None) for name in ("block_q", "block_k")]
  return backend.tiled(shape, n, q.dtype, *blocks, kv_tokens=v.shape[1] if sliced else None)


def key_side(q: jax.Array, k: jax.Array, options: AttentionOptions) -> tuple[jax.Array, jax.Array]:
  """A sliced call's key segment ids and positions `[B, Nk]`: the options' own, else the
  queries' (keys of the queries' length), else one unpadded sequence `arange(Nk)`."""
  b, nk = k.shape[:2]
  segment_ids, positions = options.key_segment_ids, options.key_positions
  if nk != q.shape[1]:
    if options.kv_segment_ids is None and options.segment_ids is not None:
      raise ValueError(
        f"keys of {nk} tokens for {q.shape[1]} queries need kv_segment_ids [B, {nk}] "
        "when segment_ids are given"
      )
    segment_ids, positions = options.kv_segment_ids, options.kv_positions
  if segment_ids is None:
    segment_ids = jnp.ones((b, nk), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
  return segment_ids, positions


def _prepare(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array] | None,
  options: AttentionOptions,
  platform: str,
):
  """Kernel config and kernel-layout inputs, plus `restore` back to `[B, N, H', dv]`."""
  b, n, _, d = q.shape
  if alphas is None:  # MHA: every head of q and of k, v is a target
    targets, num_pseudo = (q.shape[2], k.shape[2]), 1
  else:
    targets, num_pseudo = (alphas[0].shape[1], alphas[1].shape[1]), alphas[0].shape[2]
  if targets[0] % targets[1]:
    raise ValueError(
      f"{targets[0]} query target heads cannot be grouped over {targets[1]} key/value "
      "target heads: the key/value heads must divide the query heads"
    )
  sliced = options.sliced or k.shape[1] != n
  cfg = _config(platform, q, v, targets, num_pseudo, alphas is not None, options, sliced)
  if sliced:
    kv_segment_ids, kv_positions = key_side(q, k, options)
  # Flat (target h, source m, pseudo p) order: one scalar read per coefficient.
  flat = (
    ()
    if alphas is None
    else tuple(jnp.swapaxes(a, 0, 1).reshape(-1).astype(jnp.float32) for a in alphas)
  )
  rows = _BACKENDS[platform].pseudo_rows(num_pseudo)
  angles = jnp.zeros((rows, cfg.half), jnp.float32)
  if options.rope_theta is not None:
    # RoPE at virtual position pos * P + p is R(p) R(pos * P): the source heads turn by
    # R(pos * P) here (N*H*d work), the kernels by R(p) (a [P, half] table), so no
    # trigonometry runs per tile.
    positions = default_positions(q, options.positions) * num_pseudo
    q = apply_rope(q, positions, options.rope_theta)
    k_positions = kv_positions * num_pseudo if sliced else positions
    k = apply_rope(k, k_positions, options.rope_theta)
    frequencies = rope_frequencies(d, options.rope_theta)
    angles = angles.at[:, : d // 2].set(jnp.arange(rows, dtype=jnp.float32)[:, None] * frequencies)
  segment_ids = options.segment_ids
  if segment_ids is None:  # one unpadded sequence per row
    segment_ids = jnp.ones((b, n), jnp.int32)
  rotation = (jnp.cos(angles), jnp.sin(angles))
  pad = lambda ids, length: jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, length - ids.shape[1])))
  seg = pad(segment_ids, cfg.seq_len)
  if sliced:  # padded keys get segment 0 like padded queries: never seen
    offset = jnp.asarray(options.query_offset, jnp.int32).reshape(1)
    seg = (offset, seg, pad(kv_segment_ids, cfg.key_len))
  args = (
    flat,
    rotation,
    seg,
    _to_kernel(q, cfg.half, cfg.seq_len),
    _to_kernel(k, cfg.half, cfg.key_len),
    _to_kernel(v, cfg.value_half, cfg.key_len),
  )
  return cfg, args, functools.partial(_from_kernel, n=n, d=v.shape[3], half=cfg.value_half)


def pseudo_outputs(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array] | None,
  options: AttentionOptions,
  *,
  platform: str,
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """Fused attention over the virtual sequence, de-interleaved, in the kernel layout.

  q `[B, N, H, d]`, k `[B, N, G, d]`; v `[B, N, G, dv]` (dv = d for IHA; MHA may use a
  wider v); G divides H (grouped-query: query head h reads key/value head `h // (H // G)`).
  Sliced calls (a sequence shard) give k, v `[B, Nk, G, ·]` and the options' query offset
  and key-side ids / positions (defaults: the queries' when Nk = N, else one unpadded
  sequence).
  `alphas = (alpha_q, alpha_k, alpha_v)`: `alpha_q: [H, Ht, P]` (all H source heads of q
  feed the Ht target heads computed here: Ht = H, or a head shard) and `alpha_k, alpha_v:
  [G, Gt, P]` (Gt = Ht * G / H key/value targets), or None for plain MHA (Ht = H, P = 1).
  `options`: window, causal (`ops.masking.visible`), RoPE, segment ids (None: one unpadded
  sequence per row), positions, tiles and a sliced call's fields; its `implementation` is
  not read (the platform is `platform`).

  Returns `(o, restore)`: o the pseudo outputs, 5-D in the backend's `OUTPUT_SPEC` order
  (TPU `[B, Ht, P, Np, Wv]`, GPU `[B, Ht, Np, Pr, Wv]`; padded tokens, lanes and, on GPU,
  pseudo rows Pr = next_pow2(P)) and `restore`, mapping a collapsed `[B, Np, H', Wv]` to
  `[B, N, H', dv]`. The VJP saves o; IHA layers use `collapsed_outputs`, which saves
  nothing P-sized.
  """
  if platform == "tpu":
    raise ValueError(
      "pseudo_outputs is the GPU kernels' layout; on TPU use "
      "iha_jax.kernels.tpu_attention.attend_virtual (pseudo outputs [B, Ht, N, P, dv])"
    )
  cfg, args, restore = _prepare(q, k, v, alphas, options, platform)
  return _BACKENDS[platform].pseudo_view(_attend(platform, cfg, *args), cfg), restore


def collapsed_outputs(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  options: AttentionOptions,
  *,
  platform: str,
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """Fused attention and collapse of the local target heads (see `pseudo_outputs`).

  Returns `(y, restore)`: y `[B, Np, H', Wv]` float32 (H' = H for a full `[H, Ht, P]`
  collapse: a partial sum over the local target heads; H' = Ht for per_head `[Ht, P]`).
  """
  if platform == "tpu":  # mixing in HBM, then flash attention (iha_jax.kernels.tpu_attention)
    return tpu_attention.collapsed(q, k, v, alphas, collapse, options), lambda y: y
  cfg, args, restore = _prepare(q, k, v, alphas, options, platform)
  return _attend_collapse(platform, cfg, *args, collapse), restore


def fused_iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  options: AttentionOptions,
  *,
  platform: str,
) -> jax.Array:
  """Fused IHA core (docs/design.md §1.2-1.6) on source heads q `[B, N, H, d]`, k and v
  `[B, N, G, d]` (`[B, Nk, G, d]` for a sequence shard, see `pseudo_outputs`) ->
  `[B, N, H, d]`.

  The kernel behind `iha_jax.ops.iha_attention(implementation="pallas_<platform>")`
  without its checks or mesh routing. Mixing, RoPE at virtual positions and attention
  run in the kernels; the collapse is an einsum on the kernel's de-interleaved output,
  inside the custom VJP so that output is recomputed, not saved, for backward.
  """
  y, restore = collapsed_outputs(
    q, k, v, (alpha_q, alpha_k, alpha_v), collapse, options, platform=platform
  )
  return restore(y).astype(q.dtype)


def fused_mha_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, options: AttentionOptions, *, platform: str
) -> jax.Array:
  """MHA (causal or bidirectional) through the same kernels without mixing (P = 1).

  q `[B, N, H, d]`, k `[B, N, G, d]` (RoPE applies to these), v `[B, N, G, dv]` (dv may
  differ from d, e.g. 2d for differential attention) -> `[B, N, H, dv]`; G divides H. A
  sequence shard's k, v hold Nk tokens (`pseudo_outputs`).
  """
  if platform == "tpu":
    return tpu_attention.mha(q, k, v, options)
  o, restore = pseudo_outputs(q, k, v, None, options, platform=platform)
  # The pseudo view's P axis has one entry (GPU tiles may pad it: take entry 0).
  o = jnp.take(o, 0, axis=_BACKENDS[platform].OUTPUT_SPEC.index("p"))
  return restore(jnp.swapaxes(o, 1, 2))
