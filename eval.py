"""Evaluates training runs on the current devices.

  python eval.py --workdir DIR [--split test] [--step N] [--mesh data:1,fsdp:-1,tensor:1]
      restores the latest (or --step) checkpoint of DIR with the config saved in it and
      writes DIR/eval.json: loss, perplexity, token accuracy, exact match.
  python eval.py --workdir IHA --workdir MHA --sweep_lengths=128,256,512 --out_dir OUT
      exact match of each run's retrieval task at each context length:
      OUT/length_sweep.json and OUT/length_sweep.png.
  python eval.py --workdir DIR --attention_layer_number=1 --out_dir OUT
      every head's attention in that layer for one test example: OUT/<run>_layer0.png.
  python eval.py --workdir IHA --workdir TWIN --complete [--prompt='def f(x):\n']
      runs trained on text: their test loss, perplexity and bits per byte side by side,
      and a greedy and a sampled continuation of the prompt (a Python function header by
      default; `\n` and `\t` in --prompt are newline and tab) through the KV cache.

The mesh is --mesh, else the run's saved mesh when it fits the devices, else all devices
on fsdp (checkpoints restore onto any mesh). Workdirs and --out_dir may be local or URLs
(gs://...). A latest checkpoint that cannot be read or fails its checksums is skipped with
a warning naming its step. eval.py takes no workdir lock: it may read a run that trains.
The run's config is the one saved in its checkpoint (`python train.py --help` lists the
keys). Errors a person can fix print one line (`--debug` or IHA_DEBUG=1: the traceback).
"""

import json

from absl import flags

from iha_jax import cli, parallel
from iha_jax.train import metrics

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("workdir", None, "Run directory written by train.py (repeatable).")
flags.DEFINE_string("split", "test", "Dataset split to evaluate.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.DEFINE_string("mesh", None, "Mesh override, e.g. data:1,fsdp:-1,tensor:1.")
flags.DEFINE_list("sweep_lengths", None, "Context lengths of the retrieval sweep.")
flags.DEFINE_integer("sweep_examples", 128, "Examples per length in the sweep.")
flags.DEFINE_integer(
  "attention_layer_number", None, "Layer (counted from 1) whose attention maps to draw."
)
flags.DEFINE_integer("attention_example", 0, "Index of the example to draw.")
flags.DEFINE_string("out_dir", None, "Output directory of the sweep and the pictures.")
flags.DEFINE_bool("complete", False, "Text runs: metrics side by side and completions.")
flags.DEFINE_string("prompt", None, "--complete: the prompt (default: a Python function).")
flags.DEFINE_integer("max_new_tokens", 48, "--complete: tokens generated per completion.")
flags.DEFINE_float("temperature", 0.8, "--complete: temperature of the sampled completion.")
flags.DEFINE_integer("top_k", 40, "--complete: the sampled completion draws from the top k.")
flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
flags.DEFINE_bool("distributed", False, "jax.distributed.initialize() with auto-detection.")
cli.define_debug_flag()
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  metrics.quiet_library_logs()
  parallel.initialize(
    FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, auto=FLAGS.distributed
  )
  # pylint: disable-next=import-outside-toplevel
  from iha_jax.eval import attention_pictures, evaluate_workdir, length_sweep, parse_mesh, sweep_png

  mesh = None if FLAGS.mesh is None else parse_mesh(FLAGS.mesh)
  layer_number = FLAGS.attention_layer_number
  needs_out_dir = FLAGS.sweep_lengths is not None or layer_number is not None
  if needs_out_dir and not FLAGS.out_dir:
    cli.fail("--out_dir is required with --sweep_lengths or --attention_layer_number")
  if FLAGS.sweep_lengths is not None:
    result = length_sweep(
      FLAGS.workdir,
      FLAGS.sweep_lengths,
      FLAGS.out_dir,
      num_examples=FLAGS.sweep_examples,
      split=FLAGS.split,
      step=FLAGS.step,
      mesh=mesh,
    )
    print(json.dumps(result, indent=2))
    print(sweep_png(FLAGS.out_dir))
  if layer_number is not None:
    for workdir in FLAGS.workdir:
      print(
        attention_pictures(
          workdir,
          layer_number,
          FLAGS.out_dir,
          split=FLAGS.split,
          example=FLAGS.attention_example,
          step=FLAGS.step,
          mesh=mesh,
        )
      )
  if FLAGS.complete:
    complete_runs(mesh)
  elif not needs_out_dir:
    for workdir in FLAGS.workdir:
      print(json.dumps(evaluate_workdir(workdir, FLAGS.split, FLAGS.step, mesh), indent=2))


def complete_runs(mesh):
  """--complete: every run's continuations of the prompt, then their metrics side by side."""
  from iha_jax.eval import complete  # pylint: disable=import-outside-toplevel

  prompt = complete.DEFAULT_PROMPT
  if FLAGS.prompt is not None:
    prompt = FLAGS.prompt.replace("\\n", "\n").replace("\\t", "\t")
  runs = []
  for workdir in FLAGS.workdir:
    run = complete.complete_run(
      workdir,
      prompt,
      split=FLAGS.split,
      max_new_tokens=FLAGS.max_new_tokens,
      temperature=FLAGS.temperature,
      top_k=FLAGS.top_k,
      step=FLAGS.step,
      mesh=mesh,
    )
    print(complete.describe(run, prompt, FLAGS.temperature, FLAGS.top_k))
    runs.append(run)
  print("-" * 60)
  print(complete.side_by_side(runs, FLAGS.split))


if __name__ == "__main__":
  cli.run(main)
