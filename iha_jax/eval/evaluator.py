"""eval.py's evaluator: restore a run's checkpoint, evaluate one split, write eval.json."""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import ml_collections

from iha_jax import data as data_lib
from iha_jax import parallel
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import config as config_lib
from iha_jax.train import inputs
from iha_jax.train.evaluate import Evaluator
from iha_jax.train.model import LanguageModel
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import abstract_state


def evaluate_workdir(workdir: str, split: str = "test", step: int | None = None
                     ) -> dict[str, Any]:
  """Restores `workdir`'s checkpoint `step` (default latest) with the config saved in it,
  evaluates `split`, writes `workdir/eval.json` (process 0) and returns the record."""
  manager = ckpt.make_manager(workdir)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt.checkpoint_dir(workdir)}")
  config: ml_collections.ConfigDict = ckpt.restore_config(manager, step)
  model_cfg = config_lib.validate(config, jax.device_count())
  model = LanguageModel(model_cfg, remat="none", scan_layers=config.model.scan_layers)
  mesh = parallel.create_mesh(dict(config.mesh))
  target, shardings = abstract_state(model, make_optimizer(config.train), mesh)
  state = ckpt.restore(manager, step, target)
  manager.close()
  inputs.prepare(config)
  metrics = Evaluator(model, mesh, shardings.params).evaluate(
      state.params, inputs.eval_iterator(config, split))
  chance = _chance_exact_match(config)
  record = {"step": int(step), "split": split, "dataset": config.data.name, **metrics}
  if chance is not None:
    record["chance_exact_match"] = chance
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "eval.json"), "w", encoding="utf-8") as f:
      json.dump(record, f, indent=2)
  logging.info("eval %s", record)
  return record


def _chance_exact_match(config: ml_collections.ConfigDict) -> float | None:
  """Exact match of uniform guessing, for the multi-key retrieval task (else None)."""
  if not config.data.name.startswith("multikey_retrieval"):
    return None
  task = data_lib.builder_config(config.data.name, dict(config.data.options or {}))
  return float(task.num_value_tokens) ** (-task.value_len * task.num_queries)
