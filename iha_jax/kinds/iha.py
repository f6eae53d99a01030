"""Interleaved Head Attention (`I` global, `L` sliding window; docs/design.md §1)."""

from __future__ import annotations

from flax.linen import with_logical_constraint

from iha_jax.kinds.base import AttentionKind, Letter, ParamSpec, check_positive, project_qkv
from iha_jax.kinds.initializers import identity_collapse_init, identity_mixing_init
from iha_jax.ops import collapse_heads, deinterleave, iha_attention, interleave, pseudo_mix
from iha_jax.parallel.axes import HEADS, HEADS_DST, HEADS_SRC, PSEUDO, SOURCE_HEADS_AXES

COLLAPSE_MODES = ("full", "per_head")
_KERNELS = "iha_jax.kernels.sharded:iha_on_current_mesh"  # under shard_map on a mesh


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
    "reference": ("iha_jax.ops.attention:iha_reference", {}),
    "xla": ("iha_jax.ops.attention:iha_xla", {}),
    "pallas_tpu": (_KERNELS, {"platform": "tpu"}),
    "pallas_gpu": (_KERNELS, {"platform": "gpu"}),
    # Materialised pseudo q/k/v + an MHA implementation over the virtual sequence.
    "pallas_gpu_mha": ("iha_jax.ops.attention:iha_via_mha", {"mha": "pallas_gpu"}),
    "cudnn": ("iha_jax.ops.attention:iha_via_mha", {"mha": "cudnn"}),
  }
  config_fields = ("num_pseudo", "collapse_mode")
  virtual_tokens = True
  mixing_params = ("alpha_q", "alpha_k", "alpha_v", "collapse")
  decodes = True
  sequence_roles = ("q", "kv", "kv", "-", "-", "-", "-")

  def validate(self, cfg):
    check_positive("num_pseudo", cfg.num_pseudo, optional=True)
    if cfg.collapse_mode not in COLLAPSE_MODES:
      raise ValueError(f"collapse_mode must be one of {COLLAPSE_MODES}, got {cfg.collapse_mode!r}")

  def virtual_per_token(self, cfg):
    return cfg.num_heads if cfg.num_pseudo is None else cfg.num_pseudo

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    specs = super().param_specs(cfg, kernel_init, mixing_noise_std)
    h, g, p = cfg.num_heads, cfg.kv_heads, self.virtual_per_token(cfg)
    mixing = lambda heads: ParamSpec(
      (heads, heads, p), (HEADS_SRC, HEADS, PSEUDO), identity_mixing_init(mixing_noise_std)
    )
    specs.update(alpha_q=mixing(h), alpha_k=mixing(g), alpha_v=mixing(g))
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
    mixing = (params["alpha_q"], params["alpha_k"], params["alpha_v"], params["collapse"])
    return iha_attention(q, k, v, *mixing, options)

  def mixing_flops(self, cfg):
    h, g, p, d = cfg.num_heads, cfg.kv_heads, self.virtual_per_token(cfg), cfg.head_dim
    collapse = h * h * p if cfg.collapse_mode == "full" else h * p
    return 2 * (h * h + 2 * g * g) * p * d + 2 * collapse * d

  def pseudo_heads(self, params, cfg, which, x):
    return interleave(pseudo_mix(x, params[f"alpha_{which}"]))

  def collapse(self, params, cfg, out):
    return collapse_heads(deinterleave(out, self.virtual_per_token(cfg)), params["collapse"])


IHA = Interleaved()
