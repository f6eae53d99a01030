"""Saved runs, as eval.py reads them: restore a checkpoint onto the current mesh, evaluate
a split, draw attention pictures.

A checkpoint restores onto any mesh (Orbax reshards to the target shardings), so the
mesh is chosen for the devices present now: `--mesh` when given, else the mesh saved in
the run's config when it fits, else every device on the fsdp axis. Workdirs and output
directories may be local or remote (`gs://...`, through `iha_jax.storage`). The latest
checkpoint that cannot be read is skipped with a warning naming its step.
"""

from __future__ import annotations

from iha_jax.extras import require

require("train", "iha_jax.eval.runs")

import dataclasses
import functools
import json
import logging
import math
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from iha_jax import data as data_lib
from iha_jax import parallel, storage
from iha_jax.checks import is_int
from iha_jax.errors import UserError
from iha_jax.eval.attention_maps import attention_maps, plot_attention_maps
from iha_jax.models import TransformerConfig
from iha_jax.models.functional_lm import FunctionalTransformerLM, Params
from iha_jax.parallel.rules import MESH_AXES
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import config as config_lib
from iha_jax.train import inputs
from iha_jax.train.evaluator import Evaluator
from iha_jax.train.losses import loss_chunk_tokens
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import abstract_state

FALLBACK_MESH = {"data": 1, "fsdp": -1, "context": 1, "tensor": 1}


class EvalError(UserError, ValueError):
  """A bad eval.py argument (`--step`, `--mesh`, `--sweep_lengths`, ...); names the flag."""


class RunNotFoundError(UserError, FileNotFoundError):
  """`--workdir` is missing or holds no checkpoint; says what train.py command makes one."""


def parse_mesh(text: str) -> dict[str, int]:
  """`"data:1,fsdp:-1,context:1,tensor:1"` -> mesh sizes; axes left out are 1."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  for item in filter(None, (part.strip() for part in text.split(","))):
    axis, _, size = item.partition(":")
    if axis not in MESH_AXES:
      raise EvalError(f"--mesh={text!r}: unknown axis {axis!r}; axes: {', '.join(MESH_AXES)}")
    try:
      sizes[axis] = int(size)
    except ValueError:
      raise EvalError(f"--mesh={text!r}: {axis} needs an integer size, got {size!r}") from None
  return sizes


def _mesh_problem(sizes: dict[str, int], model: TransformerConfig, num_devices: int) -> str | None:
  """Why `sizes` cannot serve `model` on `num_devices` devices (None: it can)."""
  try:
    data, fsdp, context, tensor = parallel.resolve_mesh_shape(sizes, num_devices)
  except ValueError as e:
    return str(e)
  problem = config_lib.tensor_axis_problem(model, tensor)
  if problem:
    return problem
  if jax.process_count() > 1 and data * fsdp * context * tensor != num_devices:
    return f"a multi-process mesh must use all {num_devices} devices"
  return None


def choose_mesh(
  saved: dict[str, int],
  model: TransformerConfig,
  num_devices: int,
  override: dict[str, int] | None = None,
) -> dict[str, int]:
  """`override` (must fit), else `saved` if it fits, else `FALLBACK_MESH`."""
  if override is not None:
    problem = _mesh_problem(override, model, num_devices)
    if problem:
      raise EvalError(f"--mesh {override} does not fit {num_devices} devices: {problem}")
    return override
  problem = _mesh_problem(saved, model, num_devices)
  if problem is None:
    return saved
  logging.warning(
    "the saved mesh %s does not fit %d devices (%s); using %s",
    saved,
    num_devices,
    problem,
    FALLBACK_MESH,
  )
  return dict(FALLBACK_MESH)


@dataclasses.dataclass(frozen=True)
class RestoredRun:
  """A run's checkpoint restored onto the current devices (parameters only kept)."""

  workdir: str
  step: int
  config: ml_collections.ConfigDict
  model: FunctionalTransformerLM
  mesh: Mesh
  params: Params
  param_shardings: Any

  @property
  def name(self) -> str:
    return storage.basename(self.workdir)

  @property
  def eval_batch_size(self) -> int:
    """The training batch, rounded up to fill every batch shard and process."""
    batch_shards = math.prod(self.mesh.shape[a] for a in parallel.BATCH_AXES)
    rows = math.lcm(batch_shards, jax.process_count())
    return -(-self.config.train.batch_size // rows) * rows

  @functools.cached_property
  def evaluator(self) -> Evaluator:
    # One jit: each new sequence length (sweep) retraces it, with the same shardings.
    # Checkpoints saved before `train.loss` existed trained with cross-entropy.
    return Evaluator(
      self.model,
      self.mesh,
      self.param_shardings,
      self.config.train.get("loss", "cross_entropy"),
      loss_chunk_tokens(self.config.train),
    )

  def evaluate(self, config: ml_collections.ConfigDict, split: str) -> dict[str, float]:
    """Metrics of one pass over `split` of `config.data` (prepared first if needed)."""
    inputs.prepare(config)
    return self.evaluator.evaluate(
      self.params, inputs.eval_iterator(config, split, self.eval_batch_size)
    )


def restore_run(
  workdir: str, step: int | None = None, mesh: dict[str, int] | None = None
) -> RestoredRun:
  """Restores `workdir`'s checkpoint `step` (default: the newest one that can be read) with
  the config saved in it, onto `mesh` or the mesh `choose_mesh` picks for the current
  devices. `workdir` may be a local path or a URL (`gs://BUCKET/run`)."""
  workdir = storage.resolve(workdir, name="--workdir")
  if not storage.as_path(workdir).is_dir():
    raise RunNotFoundError(
      f"--workdir {workdir!r} is not a directory; train a run into it "
      f"with python train.py --config CONFIG --workdir {workdir}"
    )
  no_checkpoint = RunNotFoundError(
    f"--workdir {workdir!r}: no checkpoint in {ckpt.checkpoint_dir(workdir)}; train.py "
    f"saves one every checkpoint.every steps and at the end of the run"
  )
  if not storage.as_path(ckpt.checkpoint_dir(workdir)).is_dir():
    raise no_checkpoint
  manager = ckpt.make_manager(workdir)
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise no_checkpoint
    if step is not None and step not in steps:
      raise EvalError(f"--step={step}: {workdir!r} has checkpoints at steps {steps}")

    def restore_step(candidate: int) -> tuple[Any, ...]:
      config = ckpt.restore_config(manager, candidate)
      model_cfg = config_lib.model_config(config)
      sizes = choose_mesh(dict(config.mesh), model_cfg, jax.device_count(), mesh)
      model = FunctionalTransformerLM(model_cfg, remat="none", scan_layers=config.model.scan_layers)
      device_mesh = parallel.create_mesh(sizes)
      target, shardings = abstract_state(model, make_optimizer(config.train), device_mesh)
      state = ckpt.restore_params(manager, candidate, target)  # no optimizer moments
      return config, model, device_mesh, state, shardings

    if step is None:
      step, (config, model, device_mesh, state, shardings), _ = ckpt.restore_newest(
        manager, restore_step
      )
    else:
      try:
        config, model, device_mesh, state, shardings = restore_step(step)
      except Exception as e:  # pylint: disable=broad-except
        if not ckpt.is_read_error(e):
          raise
        raise ckpt.CheckpointError(
          f"--step={step}: the checkpoint in "
          f"{ckpt.checkpoint_dir(workdir)} cannot be read "
          f"({ckpt.describe(e)}); pick another of steps {steps}"
        ) from e
  finally:
    manager.close()
  return RestoredRun(
    workdir=workdir,
    step=int(step),
    config=config,
    model=model,
    mesh=device_mesh,
    params=state.params,
    param_shardings=shardings.params,
  )


def evaluate_workdir(
  workdir: str, split: str = "test", step: int | None = None, mesh: dict[str, int] | None = None
) -> dict[str, Any]:
  """Restores `workdir`'s checkpoint (see `restore_run`), evaluates `split`, writes
  `workdir/eval.json` (process 0) and returns the record."""
  run = restore_run(workdir, step, mesh)
  config = run.config
  record = {
    "step": run.step,
    "split": split,
    "dataset": config.data.name,
    "mesh": dict(run.mesh.shape),
    **run.evaluate(config, split),
  }
  chance = chance_exact_match(config)
  if chance is not None:
    record["chance_exact_match"] = chance
  if jax.process_index() == 0:
    storage.write_text(storage.join(run.workdir, "eval.json"), json.dumps(record, indent=2))
  logging.info("eval %s", record)
  return record


def chance_exact_match(config: ml_collections.ConfigDict) -> float | None:
  """Exact match of uniform guessing over the value tokens, for the multi-key retrieval
  and MQAR tasks (else None): every answer token of an example must be right."""
  name = config.data.name
  if not name.startswith(("multikey_retrieval", "mqar")):
    return None
  task = data_lib.builder_config(name, dict(config.data.options or {}))
  if name.startswith("mqar"):
    return float(task.num_values) ** (-task.queries)
  return float(task.num_value_tokens) ** (-task.value_len * task.num_queries)


def attention_pictures(
  workdir: str,
  layer_number: int,
  out_dir: str,
  *,
  split: str = "test",
  example: int = 0,
  step: int | None = None,
  mesh: dict[str, int] | None = None,
) -> str:
  """Draws every head's attention in layer `layer_number` (counted from 1) for test
  example `example` to `out_dir/<run>_layer<layer_number>.png` (one panel per head, P x P
  token blocks outlined) and returns the path. The maps are dense `[T, T]`: meant for
  short examples."""
  run = restore_run(workdir, step, mesh)
  num_layers = run.model.config.num_layers
  if not is_int(layer_number, 1) or layer_number > num_layers:
    raise EvalError(
      f"--attention_layer_number={layer_number!r} is out of range: {workdir!r} has "
      f"{num_layers} layers (1..{num_layers})"
    )
  if example < 0:
    raise EvalError(f"--attention_example must be >= 0, got {example}")
  # One unshuffled process-independent row: every process draws the same example.
  rows = data_lib.make_dataset(
    run.config.data,
    split,
    global_batch_size=1,
    shard_index=0,
    shard_count=1,
    shuffle=False,
    num_epochs=1,
  )
  for index, batch in enumerate(rows):  # noqa: B007 (the loop finds the row)
    if index == example:
      break
  else:
    raise EvalError(f"--attention_example={example}: split {split!r} has {index + 1} examples")
  keep = batch["segment_ids"][0] > 0
  tokens = np.asarray(batch["inputs"][0][keep])
  with parallel.activate(run.mesh):
    probs = attention_maps(run.model.module(run.params), tokens, layer_number=layer_number)
  num_pseudo = probs.shape[-1] // len(tokens)
  letter = run.model.config.schedule[layer_number - 1]
  path = storage.join(out_dir, f"{run.name}_layer{layer_number}.png")
  if jax.process_index() == 0:
    storage.makedirs(out_dir)
    plot_attention_maps(
      probs,
      num_pseudo,
      path,
      title=f"{run.name} step {run.step}, layer {layer_number} ('{letter}', "
      f"P={num_pseudo}), {split} example {example}",
    )
  return path
