"""`train.py --compile_only --target=v5p-128`: the real train step compiled for a TPU slice
or H100s this machine does not have, as a pod user's first check.

The step is `train.py`'s (`iha_jax.train.lowering`: same model, optimizer, shardings,
remat, scan and gradient accumulation) on the config's mesh over the target's
compile-only devices (`iha_jax.parallel.targets`), with the config's global batch.
Nothing is read: no data, no tokenizer (`model.vocab_size` must be given). It prints the
per-device memory the compiler assigned against the chip's HBM and each Pallas kernel's
static resources, and raises a one-line `CompileCheckError` when the step does not
compile or does not fit. Compiled, not run: no speed is measured.

`--estimate` (TPU targets) adds the step's *estimated* time per chip from libtpu's final
schedule (`iha_jax.estimate.tpu`: compute, the collectives' ICI time and the part of it
the schedule does not hide, their total) and the MFU it implies on the total: an
estimate, never a measurement.
"""

from __future__ import annotations

import math
import time

import jax
import ml_collections

from iha_jax import parallel
from iha_jax.errors import UserError
from iha_jax.estimate import tpu as tpu_estimate
from iha_jax.kinds import registry
from iha_jax.models import FunctionalTransformerLM
from iha_jax.parallel import compiled as compiled_lib
from iha_jax.parallel import targets
from iha_jax.train import config as config_lib
from iha_jax.train import flops as flops_lib
from iha_jax.train import lowering
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import abstract_state

GiB = 2**30


def _size(nbytes: int) -> str:
  return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


class CompileCheckError(UserError, RuntimeError):
  """The train step does not compile for the target, or does not fit its memory."""


def _compiler_message(error: Exception) -> str:
  """The compiler's own first meaningful line (XLA errors run to hundreds of lines)."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  for line in lines:
    if any(word in line for word in ("RESOURCE_EXHAUSTED", "Ran out of memory", "exceeded")):
      return line[:400]
  return (lines[0] if lines else type(error).__name__)[:400]


def _target_config(config: ml_collections.ConfigDict, target: targets.Target):
  config = ml_collections.ConfigDict(config.to_dict())
  if config.model.vocab_size == -1:
    raise config_lib.ConfigError(
      "--compile_only reads no data: model.vocab_size is -1 (the tokenizer's); set it, e.g. "
      "--config.model.vocab_size=128256 for Llama 3's tokenizer"
    )
  return config


def compile_only(
  config: ml_collections.ConfigDict, target_name: str, *, estimate: bool = False, log=print
):
  """Compiles `config`'s train step for `target_name`; returns `(target, report)`, and
  with `estimate` (TPU targets) logs the step's estimated time per chip and its MFU.

  Raises:
    TargetError: unknown target or its compiler packages missing (`make targets`).
    ConfigError: the config does not suit the target's device count.
    CompileCheckError: the compiler rejects the step, or it needs more memory than a chip has.
  """
  target = targets.parse(target_name)
  if estimate:
    if target.platform != "tpu":
      raise targets.TargetError(
        f"--estimate reads libtpu's schedule: use a TPU target (e.g. v5p-128), not {target.name}"
      )
    tpu_estimate.prepare()  # before libtpu starts
  devices = targets.devices(target)
  config = _target_config(config, target)
  model_cfg = config_lib.validate(config, len(devices))
  mesh = parallel.create_mesh(dict(config.mesh), devices)
  model = FunctionalTransformerLM(
    model_cfg, remat=config.model.remat_policy, scan_layers=config.model.scan_layers
  )
  tx = make_optimizer(config.train)
  target_state, shardings = abstract_state(model, tx, mesh)
  batch, seq_len = config.train.batch_size, config.data.seq_len
  rows_per_device = batch // math.prod(mesh.shape[a] for a in parallel.BATCH_AXES)
  log(
    f"compile-only: {target.name} ({target.chips} x {devices[0].device_kind}, "
    f"{target.hbm_bytes / GiB:.1f} GiB HBM each), mesh {dict(mesh.shape)}, batch {batch} x "
    f"{seq_len} tokens ({rows_per_device} per data shard, grad_accum_steps "
    f"{config.train.grad_accum_steps}), remat {config.model.remat_policy}, scan_layers "
    f"{config.model.scan_layers}, attention {config.model.implementation}"
    + (f" (as on {target.kernel_platform})" if config.model.implementation == "auto" else "")
  )
  start = time.perf_counter()
  loss = config.train.get("loss", "cross_entropy")
  step_args = (model, tx, config.train, loss, mesh, target_state, shardings, seq_len)
  estimated = None
  try:
    with registry.auto_backend(target.kernel_platform):  # "auto": the target's kernels
      if estimate:
        traced = lowering.trace_train_step(*step_args)
        with parallel.activate(mesh):
          (executable, report), estimated = tpu_estimate.estimate_traced(
            traced, target=target.name, compile_fn=compiled_lib.compile_with_report
          )
      else:
        lowered = lowering.lower_train_step(*step_args)
    if not estimate:
      _, report = compiled_lib.compile_with_report(lowered)
  except jax.errors.JaxRuntimeError as error:
    raise CompileCheckError(
      f"{target.name}: the compiler rejects the train step: {_compiler_message(error)} "
      "(smaller train.batch_size or data.seq_len, model.remat_policy='full', or a smaller "
      "model.num_pseudo shrink it; --debug shows the whole message)"
    ) from error
  log(
    f"compiled in {time.perf_counter() - start:.0f} s by the target's own compiler "
    "(compiled, not run: memory and static kernel resources, never speed)"
  )
  _log_report(report, target, log)
  if estimated is not None:
    _log_estimate(estimated, executable, model_cfg, batch, seq_len, target, log)
  if report.total_bytes > target.hbm_bytes:
    raise CompileCheckError(
      f"{target.name}: the train step needs {report.total_bytes / GiB:.1f} GiB per device, "
      f"a chip has {target.hbm_bytes / GiB:.1f} GiB: lower train.batch_size (or raise "
      "train.grad_accum_steps), use model.remat_policy='full', or a larger mesh.fsdp"
    )
  return target, report


def _log_report(report, target, log):
  """The per-device memory the compiler assigned, and each Pallas kernel's resources."""
  log(
    f"per-device memory: arguments {_size(report.argument_bytes)}, outputs "
    f"{_size(report.output_bytes)} ({_size(report.alias_bytes)} donated), temporaries "
    f"{_size(report.temp_bytes)}; total {_size(report.total_bytes)} of "
    f"{target.hbm_bytes / GiB:.1f} GiB HBM ({report.total_bytes / target.hbm_bytes:.0%})"
  )
  log(f"Pallas kernel calls: {report.kernel_calls}")
  for line in compiled_lib.kernel_table(report):
    log(line)


def _log_estimate(estimated, executable, model_cfg, batch: int, seq_len: int, target, log):
  """The step's estimated time per chip, the largest ops, and the MFU it implies; XLA's
  own FLOP count of the program (remat recomputation included) bounds it from below."""
  step_flops = flops_lib.train_flops_per_step(model_cfg, batch, seq_len)
  per_chip = step_flops / target.chips
  peak = estimated.chip.peak_bf16_flops
  mfu = per_chip / (estimated.total_s * peak)  # compute + exposed communication
  log(estimated.table(top=8))
  analysis = executable.cost_analysis() or {}
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
    analysis = analysis[0] if analysis else {}
  xla_flops = float(analysis.get("flops", 0.0))  # XLA ops only: Pallas calls count none
  if xla_flops:
    floor = xla_flops / peak
    log(
      f"XLA counts {xla_flops / 1e12:.1f} TFLOP per chip in its own ops (Pallas kernels "
      f"not counted): at peak those alone take {floor * 1e3:.1f} ms"
      + (
        "; the estimate is below that: read it as a lower bound"
        if estimated.seconds - estimated.kernel_seconds() < floor
        else ""
      )
    )
  at_least = "at least " if estimated.lower_bound else ""
  if estimated.communication is None:
    left_out = " (collectives left out)" if estimated.collectives else ""
    time_line = f"{at_least}{estimated.seconds * 1e3:.1f} ms{left_out}"
  else:
    comm = estimated.communication
    time_line = (
      f"{at_least}{estimated.total_s * 1e3:.1f} ms = compute {estimated.seconds * 1e3:.1f} + "
      f"exposed communication {estimated.exposed_s * 1e3:.1f} (collectives "
      f"{comm.total_s * 1e3:.1f} ms alone, the rest hidden behind compute)"
    )
  log(
    f"estimated step time per chip: {time_line}, "
    f"{estimated.kernel_seconds() * 1e3:.1f} ms of compute in Pallas kernels; model FLOPs "
    f"{step_flops / 1e15:.2f} PFLOP per step -> estimated MFU {mfu:.1%} at "
    f"{estimated.chip.peak_bf16_flops / 1e12:.0f} TFLOP/s per chip (an estimate from the "
    "compiler's schedule, not a measurement)"
  )
  if mfu > 1.0:  # the schedule cannot beat the chip's peak: work was left out
    log("an estimated MFU above 100% means the estimate left work out: do not use it")
