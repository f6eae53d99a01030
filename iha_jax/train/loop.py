"""The training loop: build, restore or init, compile, step, log, evaluate, checkpoint.

Guarantees:
- Restarting with the same workdir resumes from the latest checkpoint (state and data
  position) and reproduces the uninterrupted run loss for loss.
- SIGTERM (preemption) and SIGINT (Ctrl-C) make a final checkpoint at the current step
  and return; a second Ctrl-C stops at once, without saving.
- An unreadable latest checkpoint, or one whose values fail their checksums, is skipped
  with a warning naming its step; the run resumes from the newest step that restores and
  verifies, and moves the bad ones to `WORKDIR/checkpoints_unreadable/`.
- A non-finite loss or gradient norm stops the run with `NonFiniteLossError` naming which
  one, the step and what to try; the step never updated the state and nothing is saved
  after it, so the newest checkpoint (verified when restored, or saved by this run) is
  the last good one.
- One run writes a workdir: the run holds its lock (`iha_jax.workdir_lock`) from before it
  writes anything until it returns; a second run on a busy workdir refuses, naming the
  first. Bad configs, workdirs and vocabularies fail before anything is compiled
  (`iha_jax.train.preflight`).
- A full disk stops the run with `DiskFullError` (path, bytes needed, bytes free); the
  partial step is deleted and the older checkpoints kept.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from iha_jax import parallel, storage
from iha_jax.errors import UserError
from iha_jax.models import FunctionalTransformerLM
from iha_jax.parallel import context
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import config as config_lib
from iha_jax.train import flops as flops_lib
from iha_jax.train import inputs, lowering, preflight
from iha_jax.train.evaluator import Evaluator
from iha_jax.train.losses import loss_chunk_tokens
from iha_jax.train.metrics import MetricsWriter
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import TrainState, abstract_state, create_state, state_from_params


class NonFiniteLossError(UserError, RuntimeError):
  """The loss or gradient norm of a step was NaN or infinite; the message says which."""


def non_finite_message(
  step: int, loss: float, grad_norm: float, config: ml_collections.ConfigDict, checkpoint: str
) -> str:
  """What went non-finite at `step`, that the state is unharmed, where a rerun resumes
  (`checkpoint`) and the config keys to try."""
  if not np.isfinite(loss):
    what = f"the loss is {loss}" + (
      "" if np.isfinite(grad_norm) else f" (and the gradient norm {grad_norm})"
    )
  else:
    what = f"the gradient norm is {grad_norm} (the loss, {loss:.6g}, is finite)"
  t, m = config.train, config.model
  tries = [f"a lower train.learning_rate (now {t.learning_rate:g})"]
  if not t.grad_clip:
    tries.append("gradient clipping (train.grad_clip=1.0; now off)")
  if m.dtype != "float32":
    tries.append(f"model.dtype='float32' (now {m.dtype!r})")
  return (
    f"step {step}: {what}; stopped before this step changed the state. {checkpoint}. "
    f"Try {', or '.join(tries)}"
  )


class _Preemption:
  """SIGTERM or SIGINT (Ctrl-C) sets a flag; all processes agree on it before acting (same
  step). A second SIGINT raises KeyboardInterrupt: the way out when saving hangs."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = False
    self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    if signum == signal.SIGINT and self.requested:
      raise KeyboardInterrupt
    name = signal.Signals(signum).name
    logging.warning(
      "%s received: checkpointing and exiting after this step%s",
      name,
      " (Ctrl-C again: exit without saving)" if signum == signal.SIGINT else "",
    )
    self.requested = True

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    return bool(np.any(multihost_utils.process_allgather(np.asarray(self.requested))))

  def close(self) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)


def _log_memory(compiled: Any) -> None:
  """Prints the compiled step's memory analysis (per device) before step 0."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    logging.info("memory analysis: not available on this backend")
    return
  fields = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
  )
  parts = [
    f"{f.removesuffix('_size_in_bytes')}={getattr(analysis, f) / 2**20:.1f} MiB"
    for f in fields
    if hasattr(analysis, f)
  ]
  logging.info("compiled train step memory per device: %s", ", ".join(parts))


def prepare_config(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """A copy with the data directory and the tokenizer file resolved (saved with
  checkpoints, used by eval from any working directory)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.data_dir = inputs.resolve_data_dir(config, workdir)
  config.data.tokenizer = inputs.resolve_tokenizer(config)
  return config


# A hook runs after every logged step with the step and the current state; the numbers
# it returns join that step's record (metrics.jsonl, TensorBoard, the console).
Hook = Callable[[int, TrainState], Mapping[str, float] | None]


class _Clock:
  """Time per step between two logged steps, without the evals and saves in between."""

  def __init__(self, step: int):
    self.last_time, self.last_step, self.paused = time.perf_counter(), step, 0.0

  @contextlib.contextmanager
  def paused_while(self) -> Iterator[None]:
    tic = time.perf_counter()
    try:
      yield
    finally:
      self.paused += time.perf_counter() - tic

  def step_time(self, step: int) -> float:
    now = time.perf_counter()
    seconds = (now - self.last_time - self.paused) / max(step - self.last_step, 1)
    self.last_time, self.last_step, self.paused = now, step, 0.0
    return seconds


class Trainer:
  """One run: `Trainer(config, workdir).run()`, which `train` calls.

  The constructor builds everything once (config, mesh, model, data, checkpoint manager,
  the restored or fresh state, the compiled step, the evaluator); `run` steps until
  `train.total_steps`. Each concern is a method (`restore_or_init`, `compile_step`,
  `evaluate`, `save`, `log`): subclass one, or pass `hooks` to add a metric without
  editing the loop.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, hooks: Sequence[Hook] = ()):
    self.workdir = storage.resolve(workdir, name="--workdir")
    self.config = config = prepare_config(config, self.workdir)
    self.hooks = list(hooks)
    self.model_config = config_lib.validate(config, jax.device_count())
    preflight.check_vocab(config, self.model_config)
    self.mesh = parallel.create_mesh(dict(config.mesh))
    self.model = FunctionalTransformerLM(
      self.model_config, remat=config.model.remat_policy, scan_layers=config.model.scan_layers
    )
    self.tx = make_optimizer(config.train)
    self.target, self.shardings = abstract_state(self.model, self.tx, self.mesh)
    preflight.check_shardable(self.target, self.mesh, self.model_config)
    self.lock = preflight.take_workdir(self.workdir)  # before anything writes the workdir
    try:
      self._build()
    except BaseException:
      if self.lock is not None:
        self.lock.release()
      raise

  def _build(self) -> None:
    """Everything after the workdir is locked: data, checkpoints, state, the compiled step."""
    config = self.config
    self.loss = config.train.get("loss", "cross_entropy")
    logging.info("model: %s, mesh %s", self.model_config, dict(self.mesh.shape))
    if jax.process_index() == 0:  # every run states its parameters and attention FLOPs
      logging.info(
        "%s",
        flops_lib.budget_table(self.model_config, config.data.seq_len, config.train.batch_size),
      )
    inputs.prepare(config)
    self.train_it = inputs.train_iterator(config)
    self.manager = ckpt.make_manager(self.workdir, config)
    self.start, self.state = self.restore_or_init()
    # The newest checkpoint known good: restored and verified, or saved by this run.
    self.last_checkpoint: int | None = self.start or None
    self.compiled = self.compile_step()
    self.evaluator = None
    if config.eval_every:
      chunks = loss_chunk_tokens(config.train)
      self.evaluator = Evaluator(self.model, self.mesh, self.shardings.params, self.loss, chunks)
    batch, seq_len = config.train.batch_size, config.data.seq_len
    self.tokens_per_step = batch * seq_len
    self.step_flops = flops_lib.train_flops_per_step(self.model_config, batch, seq_len)
    self.peak, peak_source = flops_lib.peak_tflops_per_device()
    logging.info(
      "%.4g TFLOP per step (docs/design.md §2); peak %.4g TFLOP/s per device from %s",
      self.step_flops / 1e12,
      self.peak,
      peak_source,
    )
    self.record: dict[str, Any] = {}

  def restore_or_init(self) -> tuple[int, TrainState]:
    """`(step, state)` of the newest readable checkpoint (unreadable newer ones are set
    aside), else step 0 with the parameters of `train.init_from`'s run (a fresh
    optimizer), else `(0, a fresh state)`."""
    config, manager = self.config, self.manager

    def restore_step(step: int) -> TrainState:
      ckpt.check_compatible(ckpt.restore_config(manager, step), config)
      return ckpt.restore(manager, step, self.target, self.train_it)

    restored = ckpt.restore_newest(manager, restore_step)
    if restored is None:
      source = config.train.get("init_from")
      if source:
        source = storage.resolve(source, name="train.init_from")
        step, params = ckpt.init_params_from(source, self.target, config)
        logging.info("parameters from step %d of %s; optimizer state fresh, step 0", step, source)
        return 0, state_from_params(params, self.tx, self.shardings)
      return 0, create_state(self.model, self.tx, self.mesh, config.train.seed)[0]
    start, state, unreadable = restored
    if unreadable:
      if jax.process_index() == 0:
        ckpt.set_aside(self.workdir, unreadable)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("iha_jax unreadable checkpoints set aside")
      manager.reload()
    logging.info("resumed from step %d of %s", start, ckpt.checkpoint_dir(self.workdir))
    return start, state

  def layout(self) -> contextlib.AbstractContextManager:
    """The token layout the step is traced and fed under (`mesh.context_load_balance`:
    the balanced one, `iha_jax.parallel.context`)."""
    balanced = self.config.mesh.get("context_load_balance", False)
    return context.layout("balanced" if balanced else "contiguous")

  def compile_step(self) -> Any:
    """The train step, jitted with shardings and a donated state, compiled ahead."""
    train, seq_len = self.config.train, self.config.data.seq_len
    with self.layout():
      lowered = lowering.lower_train_step(
        self.model, self.tx, train, self.loss, self.mesh, self.target, self.shardings, seq_len
      )
    compiled = lowered.compile()
    _log_memory(compiled)
    return compiled

  def evaluate(self) -> dict[str, float]:
    """Validation metrics of the current parameters, as `eval_*` record entries."""
    results = self.evaluator.evaluate(
      self.state.params, inputs.eval_iterator(self.config, "validation")
    )
    return {f"eval_{k}": v for k, v in results.items()}

  def save(self, step: int) -> None:
    """Checkpoints `step`, unless another run took the workdir over."""
    preflight.check_lock(self.lock)
    ckpt.save(self.manager, step, self.state, self.train_it, self.config)
    self.last_checkpoint = step

  def check_finite(self, step: int, host: Mapping[str, Any]) -> None:
    """Stops the run at a NaN/inf step; that step never updated the state."""
    if not bool(host["finite"]):
      if self.last_checkpoint is None:
        where = (
          f"No checkpoint was saved yet (checkpoint.every={self.config.checkpoint.every}): "
          "a rerun starts from step 0"
        )
      else:
        where = (
          f"Last good checkpoint: step {self.last_checkpoint} in "
          f"{ckpt.checkpoint_dir(self.workdir)} (a rerun resumes there)"
        )
      raise NonFiniteLossError(
        non_finite_message(step, float(host["loss"]), float(host["grad_norm"]), self.config, where)
      )

  def state_bytes(self) -> int:
    """Bytes of the whole train state (what a checkpoint holds, before compression)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.target))

  def log(
    self, step: int, host: Mapping[str, Any], step_time: float, extra: Mapping[str, float] | None
  ) -> dict[str, Any]:
    """The record of a logged step: the step's metrics, throughput, `extra`, hooks."""
    tflops = self.step_flops / step_time / self.mesh.size / 1e12
    record = {
      "loss": float(host["loss"]),
      "grad_norm": float(host["grad_norm"]),
      "learning_rate": float(host["learning_rate"]),
      "step_time_s": step_time,
      "tokens_per_sec": self.tokens_per_step / step_time,
      "tflops_per_sec_per_device": tflops,
      "mfu": tflops / self.peak,
      **(extra or {}),
    }
    for hook in self.hooks:
      record.update(hook(step, self.state) or {})
    return record

  def run(self) -> dict[str, Any]:
    """Steps from the restored step to `train.total_steps`; returns the last record.

    Device metrics are read one step late, so the host never waits on the step it just
    launched; eval and save steps read theirs at once (the NaN check precedes a save).
    """
    config = self.config
    total, every = config.train.total_steps, config.checkpoint.every
    writer: MetricsWriter | None = None
    preemption, clock = _Preemption(), _Clock(self.start)
    pending: tuple[int, Any] | None = None  # (step, device metrics)

    def finish(
      step: int, metrics: Any, force_log: bool = False, extra: Mapping[str, float] | None = None
    ) -> None:
      host = jax.device_get(metrics)
      self.check_finite(step, host)
      if force_log or (config.log_every and step % config.log_every == 0):
        self.record = self.log(step, host, clock.step_time(step), extra)
        writer.write(step, self.record)

    try:
      writer = MetricsWriter(self.workdir, total_steps=total, initial_step=self.start)
      with parallel.activate(self.mesh), self.layout():
        for step in range(self.start + 1, total + 1):
          batch = parallel.shard_batch(next(self.train_it), self.mesh)
          self.state, metrics = self.compiled(self.state, batch)
          writer.advance()
          if pending is not None:
            finish(*pending)
          pending = (step, metrics)
          preempted = preemption.agreed()
          save_now = step % every == 0 or preempted or step == total
          eval_now = self.evaluator is not None and step % config.eval_every == 0
          if save_now or eval_now:
            extra = None
            if eval_now:
              jax.block_until_ready(metrics)
              with clock.paused_while():
                extra = self.evaluate()
            finish(step, metrics, force_log=eval_now, extra=extra)
            pending = None
            if save_now:
              with clock.paused_while():
                self.save(step)
          if preempted:
            logging.warning("preempted: saved step %d, exiting", step)
            break
        if pending is not None:
          finish(*pending)
      self.manager.wait_until_finished()  # an asynchronous save's error surfaces here
    except Exception as e:
      self.close(preemption, writer, quiet=True)  # Orbax's threads end before any cleanup
      if ckpt.is_disk_full(e):
        raise ckpt.disk_full_error(self.workdir, self.state_bytes(), e) from e
      raise
    except BaseException:  # KeyboardInterrupt (a second Ctrl-C), SystemExit
      self.close(preemption, writer, quiet=True)
      raise
    try:
      self.close(preemption, writer)
    except Exception as e:
      if ckpt.is_disk_full(e):
        raise ckpt.disk_full_error(self.workdir, self.state_bytes(), e) from e
      raise
    return self.record

  def close(self, *sinks: Any, quiet: bool = False) -> None:
    """Finishes pending saves, closes the manager and `sinks`, releases the lock. With
    `quiet` (after another error) their errors are logged, not raised."""
    closers = [self.manager.wait_until_finished, self.manager.close]
    closers += [sink.close for sink in sinks if sink is not None]
    if self.lock is not None:
      closers.append(self.lock.release)
    first = None
    for close in closers:
      try:
        close()
      except Exception as e:  # pylint: disable=broad-except
        if first is None and not quiet:
          first = e
        logging.debug("closing after an error: %s", ckpt.describe(e))
    if first is not None:
      raise first


def train(
  config: ml_collections.ConfigDict, workdir: str, *, hooks: Sequence[Hook] = ()
) -> dict[str, Any]:
  """Trains `config` in `workdir` (a local path or a URL such as `gs://BUCKET/run`) until
  `train.total_steps`; returns the last logged record. `hooks` add metrics to it."""
  return Trainer(config, workdir, hooks).run()
