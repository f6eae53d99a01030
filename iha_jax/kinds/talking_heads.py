"""Talking-Heads attention (`T`; Shazeer et al. 2020), a baseline of the paper."""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp
from flax.linen import with_logical_constraint

from iha_jax.core import validation
from iha_jax.core.masking import visible_pairs
from iha_jax.core.options import AttentionOptions, OptionFields
from iha_jax.core.talking_heads import talking_heads_reference, talking_heads_xla
from iha_jax.kinds import registry
from iha_jax.kinds.base import (
  PROJECTION_OPTIONS,
  AttentionKind,
  Letter,
  ParamSpec,
  check_no_groups,
  project_qkv,
)
from iha_jax.kinds.initializers import identity_talking_init
from iha_jax.parallel.axes import HEADS, HEADS_SRC, SOURCE_HEADS_AXES


class TalkingHeads(AttentionKind):
  """Logits mixed across heads before the softmax (`talk_logits: [H, H]`), probabilities
  after it (`talk_weights: [H, H]`), identity at init (= MHA). No kernel: "auto" runs
  the query-blocked XLA path."""

  name = "talking_heads"
  letters = (Letter("T", False, "global Talking-Heads attention"),)
  implementations = {"reference": talking_heads_reference, "xla": talking_heads_xla}
  config_fields = PROJECTION_OPTIONS
  mixing_params = ("talk_logits", "talk_weights")
  sequence_roles = ("q", "kv", "kv", "-", "-")

  def check_arrays(self, q, k, v, talk_logits, talk_weights):
    if jnp.ndim(talk_logits) == 2:
      validation.check_head_axis(q, jnp.shape(talk_logits)[0], "talk_logits [H, H]")
    h = q.shape[2]
    if validation.check_qkv(q, k, v, value_width=True) != h:
      raise ValueError(
        f"talking_heads_attention has no grouped-query form (it mixes whole heads): k and v "
        f"need the H = {h} heads of q, got G = {k.shape[2]}."
      )
    for name, x in (("talk_logits", talk_logits), ("talk_weights", talk_weights)):
      if tuple(jnp.shape(x)) != (h, h):
        raise ValueError(
          f"{name} must have shape [H, H] = [{h}, {h}] (H from q), got {tuple(jnp.shape(x))}."
        )

  def validate(self, cfg):
    check_no_groups(cfg, "it mixes the score maps of all H heads, each with its own keys")

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    specs = super().param_specs(cfg, kernel_init, mixing_noise_std)
    h = cfg.num_heads
    talk = ParamSpec((h, h), (HEADS_SRC, HEADS), identity_talking_init(mixing_noise_std))
    specs.update(talk_logits=talk, talk_weights=talk)
    return specs

  def core(self, params, x, cfg, options, layer):
    # Mixes [B, H, N, N] score maps across heads: gather the small q/k/v instead.
    q, k, v = (with_logical_constraint(t, SOURCE_HEADS_AXES) for t in project_qkv(params, x))
    return talking_heads_attention(q, k, v, params["talk_logits"], params["talk_weights"], options)

  def core_flops(self, cfg, seq_len):
    # Plus the two H x H mixings (logits and weights) of every visible pair, 2*H*H each.
    pairs = visible_pairs(seq_len, cfg.window, cfg.causal)
    return super().core_flops(cfg, seq_len) + pairs * 2 * (2 * cfg.num_heads**2)


TALKING_HEADS = TalkingHeads()


def talking_heads_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  talk_logits: jax.Array,
  talk_weights: jax.Array,
  options: AttentionOptions | None = None,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """Talking-Heads attention over `[B, N, H, ·]` inputs.

  Args:
    q, k: `[B, N, H, d]` projections before RoPE; v: `[B, N, H, dv]`.
    talk_logits, talk_weights: `[H, H]`, axes (source head, target head); identity
      matrices give plain multi-head attention.
    options, **overrides: `AttentionOptions` as `iha_attention` (window in tokens);
      `implementation` "reference", "xla" or "auto" (= "xla": no kernel exists);
      `block_sizes.block_q`, queries per block of the XLA path.

  Returns:
    `[B, N, H, dv]` in q.dtype.
  """
  mixing = (talk_logits, talk_weights)
  return registry.attend(TALKING_HEADS, q, k, v, *mixing, options=options, **overrides)
