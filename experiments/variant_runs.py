"""One training run of a study, with the library's own step, optimizer and evaluator.

How it relates to `iha_jax.train.loop.Trainer`: both run `make_train_step` and `Evaluator`.
`Trainer` is the production loop (a mesh, checkpoints, resume, preemption, metrics
files); a study instead runs hundreds of short one-device runs without checkpoints, so it
compiles each variant once and feeds the learning rate and seed in as values.

A study trains every variant many times (a learning-rate grid, then seeds). The model,
loss and batch shape of a variant are fixed, so `CompiledVariant` compiles the train
step, the init and the eval step once and every run reuses them: the peak learning
rate is a value in the optimizer state (an `inject_hyperparams` scale after AdamW with
a unit-peak schedule, which is exactly AdamW at that peak rate: optax's AdamW update,
weight decay included, is proportional to the learning rate), and the seed is an input
of the init.

A run evaluates on the validation split every `eval_every` steps, stops early after
`patience` evaluations without improvement of the selection metric, and evaluates the
best parameters on the test split. Runs use one device. On a text corpus every evaluation
also reports bits per byte (`iha_jax.data.text_stats`), and a study may select on the
loss itself (lower wins).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from iha_jax import data as data_lib
from iha_jax import parallel
from iha_jax.data import text_stats
from iha_jax.models import FunctionalTransformerLM, count_params
from iha_jax.train import config as config_lib
from iha_jax.train import flops as flops_lib
from iha_jax.train import inputs
from iha_jax.train.evaluator import Evaluator
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import make_init_fn, state_shardings
from iha_jax.train.step import make_train_step

# Selection metrics where lower is better; every other one is maximised.
LOWER_IS_BETTER = frozenset({"loss", "bits_per_byte"})


def selection_score(metrics: dict[str, float], select: str) -> tuple[float, float]:
  """Orders validation results, higher is better: `select` (negated where lower is
  better), ties broken by the lower loss; a non-finite value ranks last."""
  value = -metrics[select] if select in LOWER_IS_BETTER else metrics[select]
  loss = -metrics["loss"]
  return (value if math.isfinite(value) else -math.inf, loss if math.isfinite(loss) else -math.inf)


@dataclasses.dataclass
class RunResult:
  """What a run reports (JSON-ready)."""

  steps: int  # optimizer steps taken (early stopping may end a run early)
  best_step: int  # the step whose parameters were evaluated on test
  validation: dict[str, float]
  test: dict[str, float]
  curve: list[dict[str, float]]  # {"step", "loss" (train), and validation metrics}
  wall_s: float
  # Test metrics of the best parameters on other test sets ("axis=value" -> metrics).
  transfer: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def _unit_peak(train: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`train` with peak learning rate 1 (the final rate keeps its ratio to the peak)."""
  unit = ml_collections.ConfigDict(train.to_dict())
  unit.final_learning_rate = train.final_learning_rate / train.learning_rate
  unit.learning_rate = 1.0
  return unit


class CompiledVariant:
  """The compiled init, train step and evaluator of one study variant (model + data shape).

  Args:
    config: a full training config (configs/default.py layout) of the variant; its
      `train.learning_rate` and `train.seed` are only defaults of `run`.
  """

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.model_config = config_lib.validate(config, 1)
    self.mesh = parallel.create_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    self.model = FunctionalTransformerLM(self.model_config)
    self.loss = config.train.get("loss", "cross_entropy")
    unit = _unit_peak(config.train)
    # AdamW at peak rate 1, then a runtime scale: the run's peak learning rate.
    self.tx = optax.chain(
      make_optimizer(unit), optax.inject_hyperparams(optax.scale)(step_size=1.0)
    )
    init = make_init_fn(self.model, self.tx)
    abstract = jax.eval_shape(init, jnp.uint32(0))
    self.shardings = state_shardings(self.model, abstract, self.mesh)
    self._init = jax.jit(init, out_shardings=self.shardings)
    with parallel.activate(self.mesh):
      step = make_train_step(self.model, self.tx, learning_rate_schedule(unit), 1, self.loss)
      # Fixed in/out shardings: the init's state and a step's state share one signature,
      # so the step compiles once per variant.
      batch = parallel.batch_sharding(self.mesh)
      self._step = jax.jit(
        step,
        in_shardings=(self.shardings, batch),
        out_shardings=(self.shardings, parallel.replicated(self.mesh)),
        donate_argnums=0,
      )
    self.evaluator = Evaluator(self.model, self.mesh, self.shardings.params, self.loss)

  @property
  def params(self) -> int:
    return count_params(self.model_config)

  @property
  def num_pseudo(self) -> int | None:
    """P of the variant's IHA layers, resolved (a config's None is P = H); None when it
    has no IHA layer."""
    for letter in dict.fromkeys(self.model_config.schedule):
      p = getattr(self.model_config.attention_config(letter), "num_pseudo", None)
      if p is not None:
        return p
    return None

  @property
  def attention_flops_per_token(self) -> float:
    """Forward attention FLOPs per token, all layers (docs/design.md §2)."""
    budgets = flops_lib.layer_budgets(self.model_config, self.config.data.seq_len)
    return float(sum(b.count * b.attention_flops_per_token for b in budgets))

  @property
  def train_flops_per_step(self) -> float:
    """Model FLOPs of one training step (forward + backward, whole model)."""
    train = self.config.train
    return flops_lib.train_flops_per_step(
      self.model_config, train.batch_size, self.config.data.seq_len
    )

  def timed_steps(self, state: Any, batch: Any, steps: int) -> tuple[Any, float]:
    """`steps` train steps on one sharded `batch` from `state` (None: a fresh seed-0
    state); (the state, wall seconds per step). For cost tables, not training."""
    if state is None:
      state = self._init(jnp.uint32(0))
    with parallel.activate(self.mesh):
      tic = time.perf_counter()
      for _ in range(steps):
        state, metrics = self._step(state, batch)
      jax.block_until_ready(metrics)
    return state, (time.perf_counter() - tic) / steps

  def one_batch(self) -> Any:
    """The first training batch of seed 0, sharded for the step."""
    return parallel.shard_batch(next(inputs.train_iterator(self.config)), self.mesh)

  def run(
    self,
    learning_rate: float,
    seed: int,
    *,
    total_steps: int,
    eval_every: int,
    patience: int,
    select: str,
    on_step: Callable[[int], None] | None = None,
    transfer_tests: dict[str, ml_collections.ConfigDict] | None = None,
  ) -> RunResult:
    """Trains from `seed` at peak `learning_rate`; see the module docstring.

    Args:
      learning_rate: peak learning rate (warm-up and cosine as `config.train`).
      seed: parameter init and data order.
      total_steps: the schedule's length and the most steps taken.
      eval_every: steps between validation passes.
      patience: validation passes without a better `select` before stopping.
      select: the validation metric that picks the best step ("token_accuracy",
        "exact_match", "r_squared" for regression: maximised; "loss", "bits_per_byte":
        minimised).
      on_step: called with the step count after every step (progress bars).
      transfer_tests: named configs of other test sets (same model, e.g. longer
        sequences) on which the best parameters are evaluated too.
    """
    tic = time.perf_counter()
    config = ml_collections.ConfigDict(self.config.to_dict())
    config.train.seed = seed
    state = self._init(jnp.uint32(seed))
    # Placed like the state's other scalars, so every step sees one input signature.
    rate = jax.device_put(jnp.float32(learning_rate), parallel.replicated(self.mesh))
    state = state.replace(opt_state=optax.tree_utils.tree_set(state.opt_state, step_size=rate))
    batches = inputs.train_iterator(config)
    best: tuple[tuple[float, float], int, Any, dict[str, float]] | None = None
    curve, waited, step, losses = [], 0, 0, []
    with parallel.activate(self.mesh):
      for step in range(1, total_steps + 1):
        state, metrics = self._step(state, parallel.shard_batch(next(batches), self.mesh))
        losses.append(metrics["loss"])
        if on_step is not None:
          on_step(step)
        if step % eval_every and step != total_steps:
          continue
        train_loss = float(np.mean(jax.device_get(losses)))
        losses = []
        if not np.isfinite(train_loss):
          break  # diverged: the best parameters so far stand
        validation = self.evaluate(state.params, "validation")
        curve.append({"step": step, "loss": train_loss, **validation})
        score = selection_score(validation, select)
        if best is None or score > best[0]:
          params = jax.tree.map(lambda x: x.copy(), state.params)
          best, waited = (score, step, params, validation), 0
        else:
          waited += 1
          if waited >= patience:
            break
    if best is None:  # diverged before the first evaluation: report these parameters
      validation = self.evaluate(state.params, "validation")
      best = (selection_score(validation, select), step, state.params, validation)
    _, best_step, params, validation = best
    return RunResult(
      steps=step,
      best_step=best_step,
      validation=validation,
      test=self.evaluate(params, "test"),
      curve=curve,
      transfer={
        name: self.evaluate(params, "test", test_config)
        for name, test_config in (transfer_tests or {}).items()
      },
      wall_s=time.perf_counter() - tic,
    )

  def evaluate(
    self, params: Any, split: str, config: ml_collections.ConfigDict | None = None
  ) -> dict[str, float]:
    """Loss, token accuracy and exact match over one pass of `split` (of the variant's
    data, or of `config`'s: another test set for the same model); bits per byte on text."""
    config = config or self.config
    results = self.evaluator.evaluate(params, inputs.eval_iterator(config, split))
    keys = ("loss", "token_accuracy", "exact_match", "r_squared")  # R^2: regression only
    metrics = {k: results[k] for k in keys if k in results}
    if data_lib.is_text(config.data.name):
      scored = text_stats.scored_text(config.data, split)
      metrics["bits_per_byte"] = scored.bits_per_byte(metrics["loss"])
    return metrics
