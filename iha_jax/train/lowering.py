"""The train step as `train.py` compiles it, lowered on abstract inputs for any mesh.

One function builds it for the trainer (`Trainer.compile_step`), for `train.py
--compile_only` (a pod or GPU target compiled from a CPU host) and for `jax.export`
(`iha_jax.train.export`), so all three compile the same program: model, optimizer,
shardings, remat, scan and gradient accumulation from one config.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM, TransformerConfig
from iha_jax.train.losses import loss_chunk_tokens
from iha_jax.train.optimizer import learning_rate_schedule
from iha_jax.train.step import make_train_step


def abstract_batch(
  model_cfg: TransformerConfig, batch_size: int, seq_len: int, loss: str, rows: NamedSharding
) -> dict[str, jax.ShapeDtypeStruct]:
  """The train step's batch as `ShapeDtypeStruct`s, rows sharded by `rows`."""
  shape = (batch_size, seq_len)
  spec = lambda dtype, *extra: jax.ShapeDtypeStruct((*shape, *extra), dtype, sharding=rows)
  batch = {
    "inputs": spec(np.int32),
    "targets": spec(np.int32),
    "segment_ids": spec(np.int32),
    "positions": spec(np.int32),
    "weights": spec(np.float32),
  }
  if model_cfg.input_features is not None:  # continuous inputs [B, N, F]
    batch["features"] = spec(np.float32, model_cfg.input_features)
  if loss == "mean_squared_error":  # regression values [B, N, O]
    batch["values"] = spec(np.float32, model_cfg.num_outputs)
  return batch


def jit_train_step(
  model: FunctionalTransformerLM, tx: Any, train_cfg: Any, loss: str, mesh: Mesh, shardings: Any
) -> Any:
  """The jitted train step: state sharded by `shardings` and donated, batch rows over the
  mesh's batch axes, metrics replicated."""
  step_fn = make_train_step(
    model,
    tx,
    learning_rate_schedule(train_cfg),
    train_cfg.grad_accum_steps,
    loss,
    loss_chunk_tokens(train_cfg),
  )
  return jax.jit(
    step_fn,
    in_shardings=(shardings, parallel.batch_sharding(mesh)),
    out_shardings=(shardings, parallel.replicated(mesh)),
    donate_argnums=0,
  )


def trace_train_step(
  model: FunctionalTransformerLM,
  tx: Any,
  train_cfg: Any,
  loss: str,
  mesh: Mesh,
  target: Any,
  shardings: Any,
  seq_len: int,
) -> jax.stages.Traced:
  """`jit_train_step` traced on `target` (the abstract state) and an abstract batch of
  `train_cfg.batch_size` rows of `seq_len` tokens, under `mesh`'s logical-axis rules."""
  rows = parallel.batch_sharding(mesh)
  batch = abstract_batch(model.config, train_cfg.batch_size, seq_len, loss, rows)
  with parallel.activate(mesh):
    return jit_train_step(model, tx, train_cfg, loss, mesh, shardings).trace(target, batch)


def lower_train_step(
  model: FunctionalTransformerLM,
  tx: Any,
  train_cfg: Any,
  loss: str,
  mesh: Mesh,
  target: Any,
  shardings: Any,
  seq_len: int,
) -> jax.stages.Lowered:
  """`trace_train_step(...).lower()`, lowered under the mesh's rules as well."""
  traced = trace_train_step(model, tx, train_cfg, loss, mesh, target, shardings, seq_len)
  with parallel.activate(mesh):
    return traced.lower()
