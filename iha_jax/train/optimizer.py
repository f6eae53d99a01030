"""AdamW with linear warm-up, cosine decay to a final LR, and global-norm clipping.

Weight decay (decoupled, AdamW) applies to the weight matrices only:
- 1-D parameters (RMSNorm scales, differential attention's lambdas and norm) are never
  decayed;
- the head-mixing coefficients `iha_jax.kinds.mixing_params()` (IHA's `alpha_*`, `collapse`,
  Talking-Heads' `talk_*`) are decayed only with `train.decay_mixing=True`. Default off
  *(project)*: they are identity-initialised structural coefficients like norm gains;
  decoupled decay pulls them toward 0, not toward their identity init, which shrinks
  the pseudo-heads and the collapse. The paper states no decay rule for them.
Parameters under "scanned" (see `iha_jax.models.functional_lm`) carry a leading stacked layer axis,
so the rank test discounts it; mixing parameters are recognised by name, not rank.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import optax

from iha_jax import kinds

SCANNED = "scanned"  # top-level key of the stacked (scan-over-layers) parameters


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """0 -> `learning_rate` linearly over `warmup_steps`, then cosine to
  `final_learning_rate` at `total_steps` (the paper: 8e-4, 1000 steps, 8e-6)."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=train.learning_rate,
    warmup_steps=train.warmup_steps,
    decay_steps=train.total_steps,
    end_value=train.final_learning_rate,
  )


def decay_mask(params: Any, *, decay_mixing: bool = False) -> Any:
  """Bool pytree like `params` (nested dicts, string keys): True where AdamW decays.

  False for 1-D parameters (per layer: `scanned` leaves have one more axis), for the
  projection biases (`iha_jax.kinds.BIAS_PARAMS`: `bq: [H, d]` is 2-D, a bias all the
  same) and, unless `decay_mixing`, for every leaf whose key names a kind's head mixing
  (`iha_jax.kinds.mixing_params()`).
  """

  mixing = kinds.mixing_params()

  def leaf(path: tuple, p: Any) -> bool:
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    stacked = bool(keys) and keys[0] == SCANNED
    if p.ndim - stacked <= 1 or (keys and keys[-1] in kinds.BIAS_PARAMS):
      return False
    return decay_mixing or not (keys and keys[-1] in mixing)

  return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` then AdamW(b1, b2, eps, weight_decay) on the schedule,
  decayed as `decay_mask(decay_mixing=train.decay_mixing)`.

  `grad_clip` 0 disables clipping.
  """
  # Configs saved before `train.decay_mixing` existed (eval of old checkpoints) lack it.
  decay_mixing = bool(train.get("decay_mixing", False))
  adamw = optax.adamw(
    learning_rate_schedule(train),
    b1=train.b1,
    b2=train.b2,
    eps=train.eps,
    weight_decay=train.weight_decay,
    mask=lambda params: decay_mask(params, decay_mixing=decay_mixing),
  )
  if not train.grad_clip:
    return adamw
  return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)
