"""Evaluates a training run: `python eval.py --workdir DIR [--split test]`.

Restores the latest checkpoint of DIR with the config saved in it, reports loss,
perplexity, token accuracy and exact match (all weighted target positions of an example
right) on the split, and writes DIR/eval.json.
"""
import json

from absl import app, flags

from iha_jax import parallel
from iha_jax.train import metrics

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory written by train.py.")
flags.DEFINE_string("split", "test", "Dataset split to evaluate.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
flags.DEFINE_bool("distributed", False, "jax.distributed.initialize() with auto-detection.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  metrics.quiet_library_logs()
  parallel.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                      auto=FLAGS.distributed)
  from iha_jax.eval import evaluate_workdir  # pylint: disable=import-outside-toplevel
  print(json.dumps(evaluate_workdir(FLAGS.workdir, FLAGS.split, FLAGS.step), indent=2))


if __name__ == "__main__":
  app.run(main)
