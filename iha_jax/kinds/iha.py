"""Interleaved Head Attention (`I` global, `L` sliding window; docs/design.md §1)."""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp
from flax.linen import with_logical_constraint

from iha_jax.checks import check_positive
from iha_jax.core import validation
from iha_jax.core.attention import iha_probabilities, iha_reference, iha_via_mha, iha_xla
from iha_jax.core.cudnn_attention import mha_cudnn
from iha_jax.core.interleave import deinterleave, interleave
from iha_jax.core.mixing import collapse_heads, pseudo_mix
from iha_jax.core.options import AttentionOptions, OptionFields
from iha_jax.kernels.sharded import (
  iha_gpu_window_on_current_mesh,
  iha_on_current_mesh,
  iha_window_on_current_mesh,
)
from iha_jax.kinds import registry
from iha_jax.kinds.base import PROJECTION_OPTIONS, AttentionKind, Letter, ParamSpec, project_qkv
from iha_jax.kinds.initializers import identity_collapse_init, identity_mixing_init
from iha_jax.kinds.mha import MHA
from iha_jax.parallel.axes import HEADS, HEADS_DST, HEADS_SRC, KV_HEADS, PSEUDO, SOURCE_HEADS_AXES

COLLAPSE_MODES = ("full", "per_head")


class Interleaved(AttentionKind):
  """Every head mixes all H source heads into P pseudo-heads (`alpha_q, alpha_k, alpha_v:
  [H, H, P]`), attends over `T = N * P` virtual tokens, and collapses the P outputs
  (`collapse: [H, H, P]` full, or `[H, P]` per head). Window in virtual tokens.
  Grouped-query (G = `num_kv_heads` < H): `wk, wv: [D, G, d]`, and `alpha_k, alpha_v:
  [G, G, P]` mix the G key/value heads among themselves; query head h attends with the
  pseudo-keys and pseudo-values of key/value head `h // (H // G)`."""

  name = "iha"
  letters = (
    Letter("I", False, "global IHA"),
    Letter("L", True, "sliding-window IHA, window iha_window (virtual tokens)"),
  )
  implementations = {
    "reference": iha_reference,
    "xla": iha_xla,
    # The Pallas kernels, under shard_map on a mesh.
    "pallas_tpu": functools.partial(iha_on_current_mesh, platform="tpu"),
    "pallas_gpu": functools.partial(iha_on_current_mesh, platform="gpu"),
    # Sliding windows with the pseudo-heads made, attended and collapsed in VMEM (TPU).
    "pallas_tpu_window": iha_window_on_current_mesh,
    # Its GPU twin (Triton; forward and backward on chip).
    "pallas_gpu_window": iha_gpu_window_on_current_mesh,
    # Materialised pseudo q/k/v + an MHA implementation over the virtual sequence.
    "pallas_gpu_mha": functools.partial(iha_via_mha, mha=MHA.implementations["pallas_gpu"]),
    "cudnn": functools.partial(iha_via_mha, mha=mha_cudnn),
    "splash": functools.partial(iha_via_mha, mha=MHA.implementations["splash"]),
  }
  config_fields = ("num_pseudo", "collapse_mode", *PROJECTION_OPTIONS)
  virtual_tokens = True
  mixing_params = ("alpha_q", "alpha_k", "alpha_v", "collapse")
  dropout_implementations = frozenset({"xla"})
  probability_implementations = {"xla": iha_probabilities}
  decodes = True
  sequence_roles = ("q", "kv", "kv", "-", "-", "-", "-")

  def validate(self, cfg):
    check_positive("num_pseudo", cfg.num_pseudo, optional=True)
    if cfg.collapse_mode not in COLLAPSE_MODES:
      raise ValueError(f"collapse_mode must be one of {COLLAPSE_MODES}, got {cfg.collapse_mode!r}")

  def check_arrays(self, q, k, v, alpha_q, alpha_k, alpha_v, collapse, sliced=False):
    if jnp.ndim(alpha_q) == 3:
      validation.check_head_axis(q, jnp.shape(alpha_q)[0], "alpha_q [H, H, P]")
    num_kv_heads = validation.check_qkv(q, k, v, sliced=sliced)
    validation.check_mixing(q.shape[2], alpha_q, alpha_k, alpha_v, collapse, num_kv_heads)

  def auto_inputs(self, q, k, v, alpha_q, alpha_k, alpha_v, collapse):
    return q, v, alpha_q.shape[2]

  def num_pseudo(self, cfg):
    return cfg.num_pseudo  # resolved by AttentionConfig (None -> H)

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    specs = super().param_specs(cfg, kernel_init, mixing_noise_std)
    h, g, p = cfg.num_heads, cfg.kv_heads, self.num_pseudo(cfg)
    mixing = lambda heads, axis: ParamSpec(
      (heads, heads, p), (HEADS_SRC, axis, PSEUDO), identity_mixing_init(mixing_noise_std)
    )
    specs.update(alpha_q=mixing(h, HEADS), alpha_k=mixing(g, KV_HEADS), alpha_v=mixing(g, KV_HEADS))
    collapse_init = identity_collapse_init(mixing_noise_std)
    if cfg.collapse_mode == "full":
      specs["collapse"] = ParamSpec((h, h, p), (HEADS_DST, HEADS, PSEUDO), collapse_init)
    else:
      specs["collapse"] = ParamSpec((h, p), (HEADS, PSEUDO), collapse_init)
    return specs

  def core(self, params, x, cfg, options, layer):
    # Gather the small source-head q/k/v over the head axis rather than communicate
    # P-times larger pseudo-heads (a no-op unless a mesh and logical rules are active).
    q, k, v = (with_logical_constraint(t, SOURCE_HEADS_AXES) for t in project_qkv(params, x))
    return iha_attention(*self.entry_arrays(params, q, k, v, cfg), options)

  def entry_arrays(self, params, q, k, v, cfg):
    return q, k, v, params["alpha_q"], params["alpha_k"], params["alpha_v"], params["collapse"]

  def mixing_flops(self, cfg):
    h, g, p, d = cfg.num_heads, cfg.kv_heads, self.num_pseudo(cfg), cfg.head_dim
    collapse = h * h * p if cfg.collapse_mode == "full" else h * p
    return 2 * (h * h + 2 * g * g) * p * d + 2 * collapse * d

  def pseudo_heads(self, params, cfg, which, x):
    return interleave(pseudo_mix(x, params[f"alpha_{which}"]))

  def collapse(self, params, cfg, out):
    return collapse_heads(deinterleave(out, self.num_pseudo(cfg)), params["collapse"])


IHA = Interleaved()


def iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  options: AttentionOptions | None = None,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """Interleaved Head Attention core (docs/design.md, "The math").

  Args:
    q: source-head query projections before RoPE, `[B, N, H, d]`.
    k, v: source key/value projections, `[B, N, G, d]`, G dividing H (G = H: multi-head;
      G < H: grouped-query, G = 1: multi-query).
    alpha_q: query mixing `[H, H, P]` (source, target, pseudo).
    alpha_k, alpha_v: key/value mixing `[G, G, P]`.
    collapse: `[H, H, P]` (full) or `[H, P]` (per_head).
    options: the shared options (`AttentionOptions`; `window` in VIRTUAL tokens here).
    **overrides: any `AttentionOptions` field as a keyword (`window=8`, ...), applied
      over `options`.

  Returns:
    `[B, N, H, d]` in q.dtype, before the output projection.
  """
  mixing = (alpha_q, alpha_k, alpha_v, collapse)
  return registry.attend(IHA, q, k, v, *mixing, options=options, **overrides)
