"""Multi-process start-up: `jax.distributed.initialize` before the backend starts."""

from __future__ import annotations

import logging
import os

import jax

# Environment fall-backs for the flags of train.py / eval.py.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  auto: bool = False,
) -> bool:
  """Joins a multi-process run when one is requested; returns whether it did.

  Multi-process when a coordinator address is given (argument or
  `JAX_COORDINATOR_ADDRESS`) or `auto` is set (TPU pod slices, SLURM, Open MPI and
  Kubernetes, where JAX detects the cluster itself). Otherwise a single-process run and
  nothing happens. Must run before any JAX computation.

  CPU processes exchange collectives through gloo (set here; harmless on GPU/TPU, where
  the option only concerns the CPU client).
  """
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and os.environ.get(ENV_PROCESS_ID):
    process_id = int(os.environ[ENV_PROCESS_ID])
  if coordinator_address is None and not auto:
    if num_processes not in (None, 1):
      raise ValueError(
        f"num_processes={num_processes} needs a coordinator address "
        f"(--coordinator_address or {ENV_COORDINATOR}), or --distributed on a "
        "cluster JAX detects by itself"
      )
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  logging.info(
    "process %d of %d joined (coordinator %s)",
    jax.process_index(),
    jax.process_count(),
    coordinator_address or "auto-detected",
  )
  return True
