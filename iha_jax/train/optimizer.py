"""AdamW with linear warm-up, cosine decay to a final LR, and global-norm clipping."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """0 -> `learning_rate` linearly over `warmup_steps`, then cosine to
  `final_learning_rate` at `total_steps` (the paper: 8e-4, 1000 steps, 8e-6)."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps,
      decay_steps=train.total_steps, end_value=train.final_learning_rate)


def _decay_mask(params):
  """Weight decay on matrices only; norm scales (1-D) are not decayed."""
  return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` then AdamW(b1, b2, eps, weight_decay) on the schedule.

  `grad_clip` 0 disables clipping.
  """
  adamw = optax.adamw(learning_rate_schedule(train), b1=train.b1, b2=train.b2,
                      eps=train.eps, weight_decay=train.weight_decay, mask=_decay_mask)
  if not train.grad_clip:
    return adamw
  return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)
