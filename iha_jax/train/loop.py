"""The training loop: build, restore or init, compile, step, log, evaluate, checkpoint.

Guarantees:
- Restarting with the same workdir resumes from the latest checkpoint (state and data
  position) and reproduces the uninterrupted run loss for loss.
- SIGTERM (preemption) and SIGINT (Ctrl-C) make a final checkpoint at the current step
  and return; a second Ctrl-C stops at once, without saving.
- An unreadable latest checkpoint is skipped with a warning naming its step; the run
  resumes from the newest step that restores and moves the bad ones to
  `WORKDIR/checkpoints_unreadable/`.
- A non-finite loss or gradient stops the run with `NonFiniteLossError`; the step
  never updated the state and nothing is saved after it, so the latest checkpoint is
  the last good one.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from iha_jax import parallel, storage
from iha_jax.errors import UserError
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import config as config_lib
from iha_jax.train.evaluate import Evaluator
from iha_jax.train import flops as flops_lib
from iha_jax.train import inputs
from iha_jax.train.metrics import MetricsWriter
from iha_jax.train.model import LanguageModel
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import abstract_state, create_state
from iha_jax.train.step import make_train_step


class NonFiniteLossError(UserError, RuntimeError):
  """The loss or gradient norm of a step was NaN or infinite."""


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
    logging.warning("%s received: checkpointing and exiting after this step%s", name,
                    " (Ctrl-C again: exit without saving)" if signum == signal.SIGINT else "")
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
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  parts = [f"{f.removesuffix('_size_in_bytes')}={getattr(analysis, f) / 2**20:.1f} MiB"
           for f in fields if hasattr(analysis, f)]
  logging.info("compiled train step memory per device: %s", ", ".join(parts))


def prepare_config(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """A copy with the data directory and the tokenizer file resolved (saved with
  checkpoints, used by eval from any working directory)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.data_dir = inputs.resolve_data_dir(config, workdir)
  config.data.tokenizer = inputs.resolve_tokenizer(config)
  return config


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir` (a local path or a URL such as `gs://BUCKET/run`) until
  `train.total_steps`; returns the last metrics."""
  workdir = storage.resolve(workdir, name="--workdir")
  config = prepare_config(config, workdir)
  model_cfg = config_lib.validate(config, jax.device_count())
  mesh = parallel.create_mesh(dict(config.mesh))
  model = LanguageModel(model_cfg, remat=config.model.remat_policy,
                        scan_layers=config.model.scan_layers)
  tx = make_optimizer(config.train)
  logging.info("model: %s, mesh %s", model_cfg, dict(mesh.shape))
  if jax.process_index() == 0:  # every run states its parameters and attention FLOPs
    logging.info("%s", flops_lib.budget_table(model_cfg, config.data.seq_len,
                                              config.train.batch_size))

  inputs.prepare(config)
  train_it = inputs.train_iterator(config)
  manager = ckpt.make_manager(workdir, config)
  target, shardings = abstract_state(model, tx, mesh)

  def restore_step(step: int):
    ckpt.check_compatible(ckpt.restore_config(manager, step), config)
    return ckpt.restore(manager, step, target, train_it)

  restored = ckpt.restore_newest(manager, restore_step)
  if restored is not None:
    start, state, unreadable = restored
    if unreadable:
      if jax.process_index() == 0:
        ckpt.set_aside(workdir, unreadable)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("iha_jax unreadable checkpoints set aside")
      manager.reload()
    logging.info("resumed from step %d of %s", start, ckpt.checkpoint_dir(workdir))
  else:
    state, _ = create_state(model, tx, mesh, config.train.seed)
    start = 0

  batch_sharding = parallel.batch_sharding(mesh)
  loss = config.train.get("loss", "cross_entropy")
  step_fn = make_train_step(model, tx, learning_rate_schedule(config.train),
                            config.train.grad_accum_steps, loss)
  seq_len, batch_size = config.data.seq_len, config.train.batch_size
  abstract_batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=batch_sharding)
                    for k, dtype in (("inputs", np.int32), ("targets", np.int32),
                                     ("segment_ids", np.int32), ("positions", np.int32),
                                     ("weights", np.float32))}
  with parallel.activate(mesh):
    compiled = jax.jit(step_fn, in_shardings=(shardings, batch_sharding),
                       out_shardings=(shardings, parallel.replicated(mesh)),
                       donate_argnums=0).lower(target, abstract_batch).compile()
  _log_memory(compiled)
  evaluator = Evaluator(model, mesh, shardings.params, loss) if config.eval_every else None

  step_flops = flops_lib.train_flops_per_step(model_cfg, batch_size, seq_len)
  peak, peak_source = flops_lib.peak_tflops_per_device()
  logging.info("%.4g TFLOP per step (docs/design.md §2); peak %.4g TFLOP/s per device from %s",
               step_flops / 1e12, peak, peak_source)

  writer = MetricsWriter(workdir, total_steps=config.train.total_steps, initial_step=start)
  preemption = _Preemption()
  pending: tuple[int, Any] | None = None  # (step, device metrics): read one step late
  last_time, last_step, record = time.perf_counter(), start, {}
  paused = 0.0  # seconds spent in evals and checkpoint saves, kept out of step times

  def finish(step: int, metrics: Any, force_log: bool = False,
             extra: dict[str, float] | None = None) -> None:
    nonlocal last_time, last_step, record, paused
    host = jax.device_get(metrics)
    if not bool(host["finite"]):
      latest = manager.latest_step()
      raise NonFiniteLossError(
          f"step {step}: non-finite loss {float(host['loss'])} / grad_norm "
          f"{float(host['grad_norm'])}; stopping. The state was not updated by this step; "
          f"last good checkpoint: step {latest} in {ckpt.checkpoint_dir(workdir)}")
    if not (force_log or (config.log_every and step % config.log_every == 0)):
      return
    now = time.perf_counter()
    step_time = (now - last_time - paused) / max(step - last_step, 1)
    last_time, last_step, paused = now, step, 0.0
    tflops = step_flops / step_time / mesh.size / 1e12
    record = {"loss": float(host["loss"]), "grad_norm": float(host["grad_norm"]),
              "learning_rate": float(host["learning_rate"]), "step_time_s": step_time,
              "tokens_per_sec": batch_size * seq_len / step_time,
              "tflops_per_sec_per_device": tflops, "mfu": tflops / peak, **(extra or {})}
    writer.write(step, record)

  try:
    with parallel.activate(mesh):
      for step in range(start + 1, config.train.total_steps + 1):
        batch = parallel.shard_batch(next(train_it), mesh)
        state, metrics = compiled(state, batch)
        writer.advance()
        if pending is not None:
          finish(*pending)
        pending = (step, metrics)
        preempted = preemption.agreed()
        save_now = (step % config.checkpoint.every == 0 or preempted
                    or step == config.train.total_steps)
        eval_now = evaluator is not None and step % config.eval_every == 0
        if save_now or eval_now:
          extra = None
          if eval_now:
            jax.block_until_ready(metrics)
            tic = time.perf_counter()
            results = evaluator.evaluate(state.params, inputs.eval_iterator(config, "validation"))
            extra = {f"eval_{k}": v for k, v in results.items()}
            paused += time.perf_counter() - tic
          finish(step, metrics, force_log=eval_now, extra=extra)  # also the NaN check
          pending = None
          if save_now:
            tic = time.perf_counter()
            ckpt.save(manager, step, state, train_it, config)
            paused += time.perf_counter() - tic
        if preempted:
          logging.warning("preempted: saved step %d, exiting", step)
          break
      if pending is not None:
        finish(*pending)
  finally:
    manager.wait_until_finished()
    manager.close()
    preemption.close()
    writer.close()
  return record
