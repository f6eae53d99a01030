"""Attention layer configuration and parameter layout, shared by the NNX and Linen modules:
`param_specs` reads the kind records' layout (`iha_jax.kinds`), so the two front ends
build one parameter tree, each parameter with its logical axis names
(`iha_jax.parallel.axes`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from iha_jax import kinds
from iha_jax.checks import check_positive
from iha_jax.kinds import AttentionConfig, ParamSpec
from iha_jax.kinds.iha import COLLAPSE_MODES

DEFAULT_KERNEL_INIT = jax.nn.initializers.lecun_normal()


def param_specs(
  cfg: AttentionConfig,
  *,
  kernel_init: jax.nn.initializers.Initializer = DEFAULT_KERNEL_INIT,
  mixing_noise_std: float = 0.0,
) -> dict[str, ParamSpec]:
  """`{name: ParamSpec}` of every parameter of the layer, in creation order, as `cfg.kind`'s
  record lays them out (the layer classes list them; `AttentionKind.param_specs`).

  Args:
    cfg: the layer configuration.
    kernel_init: 2-D initializer for the projections, applied to the folded matrices
      `[D, H*d]` (wq, wk, wv, ...) and `[H*d, D]` (wo) so fan-in is computed correctly.
    mixing_noise_std: std of the Gaussian noise added to the identity init of the head
      mixings (`alpha_*`, `collapse`, `talk_*`).
  """
  if not mixing_noise_std >= 0:
    raise ValueError(f"mixing_noise_std must be >= 0, got {mixing_noise_std!r}")
  return cfg.record.param_specs(cfg, kernel_init, mixing_noise_std)


def layer_config(
  *,
  window_tokens: int | None = None,
  in_features: int | None = None,
  qkv_features: int | None = None,
  normalize_qk: bool | None = None,
  **fields: Any,
) -> AttentionConfig:
  """The `AttentionConfig` of a layer built with `fields` (its fields), where flax's names
  may stand for two of them and a token count for the window:
  - `in_features` (flax's name): `model_dim`;
  - `qkv_features` (flax's name, H*d): `head_dim = qkv_features // num_heads`; left out
    with `head_dim` too, `in_features` (flax's default; not `model_dim`);
  - `normalize_qk` (flax's LayerNorm of q and k): False or None only; `qk_norm=True` is
    this layer's (an RMSNorm);
  - `window_tokens`, instead of `window`: a window counted in TOKENS, which a kind over
    virtual tokens (IHA) takes as `window_tokens * P` virtual tokens (the span of
    `window_tokens` tokens: pseudo-query p < P-1 of token n reaches token
    n - window_tokens, so an output depends on window_tokens + 1 tokens, one more than
    through MHA's window of window_tokens), and any other kind as its window.
  Raises ValueError naming the field for a bad one, or for a field given under both
  names."""
  if normalize_qk not in (None, False):
    raise ValueError(
      f"normalize_qk={normalize_qk!r} (flax's LayerNorm of q and k) is not taken: this layer's "
      "is qk_norm=True (an RMSNorm of every query and key head, without mean)"
    )
  if qkv_features is None and fields.get("head_dim") is None and in_features is not None:
    qkv_features = in_features  # flax's MultiHeadAttention default
  fields = _flax_names(fields, in_features, qkv_features)
  if window_tokens is None:
    return AttentionConfig(**fields)
  if fields.get("window") is not None:
    raise ValueError(
      f"give window (in the kind's units: VIRTUAL tokens for IHA) or window_tokens (in "
      f"tokens), not both: got window={fields['window']!r}, window_tokens={window_tokens!r}"
    )
  check_positive("window_tokens", window_tokens)
  cfg = AttentionConfig(**{**fields, "window": None})
  return dataclasses.replace(cfg, window=window_tokens * cfg.record.num_pseudo(cfg))


def _flax_names(
  fields: dict[str, Any], in_features: int | None, qkv_features: int | None
) -> dict[str, Any]:
  """`fields` with `model_dim` and `head_dim` read from flax's `in_features` and
  `qkv_features` where given (each name or its flax name, not both)."""
  fields = dict(fields)
  if in_features is not None:
    if fields.get("model_dim") is not None:
      raise ValueError(
        f"give model_dim or in_features (flax's name for it), not both: got model_dim="
        f"{fields['model_dim']!r}, in_features={in_features!r}"
      )
    fields["model_dim"] = in_features
  if qkv_features is not None:
    if fields.get("head_dim") is not None:
      raise ValueError(
        f"give head_dim or qkv_features (flax's name for num_heads * head_dim), not both: "
        f"got head_dim={fields['head_dim']!r}, qkv_features={qkv_features!r}"
      )
    check_positive("qkv_features", qkv_features)
    heads = fields.get("num_heads")
    check_positive("num_heads", heads)
    if qkv_features % heads:
      raise ValueError(
        f"qkv_features={qkv_features} must be a multiple of num_heads={heads} (head_dim = "
        "qkv_features // num_heads)"
      )
    fields["head_dim"] = qkv_features // heads
  flax_names = {"model_dim": " (or in_features)", "num_heads": "", "head_dim": " (or qkv_features)"}
  for name, flax_name in flax_names.items():
    if fields.get(name) is None:
      raise ValueError(f"{name}{flax_name} is required, got None")
  return fields


# Head-mixing parameters of the built-in kinds (identity-initialised coefficients, no
# projections): the optimizer's weight-decay switch and noise option act on these and on
# those of any kind registered later (`iha_jax.kinds.mixing_params()`).
MIXING_PARAMS = kinds.mixing_params()

__all__ = [
  "COLLAPSE_MODES",
  "DEFAULT_KERNEL_INIT",
  "MIXING_PARAMS",
  "AttentionConfig",
  "ParamSpec",
  "layer_config",
  "param_specs",
]
