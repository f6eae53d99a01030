"""Trains a language model: `python train.py --config configs/default.py --workdir DIR`.

Any attention schedule (IHA, MHA, Talking-Heads, differential, 2-simplicial); at start,
process 0 logs the run's budget (`iha_jax.train.flops.budget_table`): parameters and
attention FLOPs per token of every layer kind, and the train FLOPs per step.

Override any config key with `--config.KEY=VALUE` (e.g. `--config.train.total_steps=100`);
`--help` lists every key of the config with its value. The workdir may be local or a URL
(`gs://BUCKET/run`). Re-running resumes from the newest checkpoint that reads and matches
its checksums; SIGTERM and Ctrl-C save the current step and exit. One run writes a workdir
at a time: a second one refuses, naming the first. Errors a person can fix print one line
(`--debug` or IHA_DEBUG=1: the traceback).
Multi-process: `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables), or
`--distributed` where JAX detects the cluster itself (TPU pod slices, SLURM, Open MPI).

Before a pod run, from any CPU machine: `--compile_only --target=v5p-128` (or v5e-256,
v6e-256, v4-128, h100, h100x8, ...) compiles this train step with the target's own
compiler and prints its per-device memory and kernels, exiting 1 when it does not compile
or fit (needs `make targets`; no workdir, no data; compiled, not run).
"""

from absl import flags
from ml_collections import config_flags

from iha_jax import cli, parallel
from iha_jax.train import metrics

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  "config", None, "Training config file (configs/*.py).", lock_config=True
)
flags.DEFINE_string(
  "workdir", None, "Run directory (local or gs://...): checkpoints, metrics, TensorBoard."
)
flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
flags.DEFINE_bool(
  "compile_only",
  False,
  "Compile the train step for --target without its hardware, print memory and kernels, exit.",
)
flags.DEFINE_string(
  "target", None, "--compile_only target: v5p-128, v5e-256, v6e-256, v4-128, h100, h100x8, ..."
)
flags.DEFINE_bool(
  "estimate",
  False,
  "With --compile_only on a TPU target: also print the step's estimated time per chip and "
  "MFU from libtpu's schedule (an estimate, not a measurement).",
)
flags.DEFINE_bool(
  "distributed",
  False,
  "Call jax.distributed.initialize() with cluster "
  "auto-detection (TPU pod slices, SLURM, Open MPI, Kubernetes).",
)
cli.define_debug_flag()
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  metrics.quiet_library_logs()
  if FLAGS.compile_only or FLAGS.target:
    if not (FLAGS.compile_only and FLAGS.target):
      cli.fail("--compile_only and --target go together (e.g. --compile_only --target=v5p-128)")
    from iha_jax.train import compile_check  # pylint: disable=import-outside-toplevel

    compile_check.compile_only(FLAGS.config, FLAGS.target, estimate=FLAGS.estimate)
    return
  if FLAGS.estimate:
    cli.fail("--estimate goes with --compile_only --target=<TPU slice> (e.g. v5p-128)")
  if FLAGS.workdir is None:
    cli.fail("--workdir is required (a local path or gs://...), unless --compile_only")
  # Before any JAX computation: joining a multi-process run must precede backend start.
  parallel.initialize(
    FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, auto=FLAGS.distributed
  )
  from iha_jax.train import train  # pylint: disable=import-outside-toplevel

  train(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  cli.run(main, help_extra=cli.config_keys_help)
