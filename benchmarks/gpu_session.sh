#!/usr/bin/env bash
# The measurements to take on a GPU machine, stage by stage (docs/performance.md §12 says
# what each gives).
#
#   bash benchmarks/gpu_session.sh                       (the default plan, below)
#   bash benchmarks/gpu_session.sh STAGE[:SECONDS] ...   (chosen stages)
#   bash benchmarks/gpu_session.sh --plan                (print the default plan, run nothing)
#
# Stages: env (versions, devices); kernel_tests (the Pallas kernel tests, compiled);
# kernels2 / kernels4 / kernels20 (benchmarks/kernels.py
# at P = 2, 4, 20: window and global IHA and global MHA; fused kernels vs our MHA kernel
# on materialised pseudo q/k/v vs cuDNN on materialised, forward and forward+backward,
# after the same run's matmul rate); window (the on-chip window path, pallas_gpu_window,
# against pallas_gpu and cuDNN on materialised pseudo q/k/v: the window IHA layer at P = 4
# and P = 20, forward and forward+backward); train / train_nosegs (benchmarks/train_step.py, the
# ~350M LLLLM against its M twin, with packed-style segment ids / without); train_pallas
# (that IHA step with every layer on `pallas_gpu`); tests
# (kernel, attention-kind and GPU-path tests on the real GPU, not interpret mode); static
# (the timed kernel shapes compiled for this GPU). Each stage's log goes to
# $OUT/<stage>.log; a stage stops at its SECONDS (default 300) without stopping the next.
# With no stage named, DEFAULT_PLAN runs, in order of value, within one 10-minute call
# (wheel installs included). Without a GPU it stops at once (exit 2), before installing
# anything. The machine reaches no registry: wheels for what its image lacks travel in
# .whl/ (`make gpu-wheels` builds it from requirements-gpu-machine.txt).
set -u
# (a) the kernel table at P = 4 and 2, (b) the step, packed and unpacked, (c) the kernel
# tests. Limits from an H200 run (2026-11-26, rebuilt kernels): kernels4 41 s, a train
# stage ~90 s per config (compile, 3 + 10 steps), kernel_tests 56 s; `tests` (102 s)
# does not fit beside them: run it in a call of its own.
DEFAULT_PLAN="env:15 kernels4:60 kernels2:50 train:190 train_nosegs:180 kernel_tests:60"
if [ "${1:-}" = "--plan" ]; then
  total=0
  for spec in $DEFAULT_PLAN; do echo "$spec"; total=$((total + ${spec#*:})); done
  echo "total ${total}s"
  exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_session: no GPU here (nvidia-smi finds none): nothing run"
  exit 2
fi
[ $# -eq 0 ] && set -- $DEFAULT_PLAN
OUT=${OUT:-/tmp/iha_gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if [ -d .whl ] && [ -z "${IHA_WHEELS_DONE:-}" ]; then
  rm -rf /tmp/site  # a warm machine keeps the last call's installs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export IHA_WHEELS_DONE=1

run_stage() {
  local stage=$1 seconds=$2
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
        --format=csv
      python3 -c "import sys, jax, jaxlib, flax, optax, chex, orbax.checkpoint as o; \
print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__); \
print(jax.devices()); import iha_jax.train, iha_jax.data; print('iha_jax imports ok')"
      which ptxas && ptxas --version | tail -1 ;;
    kernel_tests)  # the Pallas kernels alone, compiled (a quick check before timing them)
      timeout "$seconds" python3 -m pytest -q -n 4 -p no:cacheprovider \
        tests/kernels/test_kernels.py tests/kinds/test_gqa.py -k "gpu and not sharded" ;;
    tests)
      timeout "$seconds" python3 -m pytest -q -n 4 -p no:cacheprovider \
        tests/kernels/test_kernels.py tests/kinds/test_attention_kinds.py tests/kernels/test_gpu_paths.py \
        -k "not tpu" ;;
    static)
      timeout "$seconds" python3 benchmarks/compile_matrix.py --on_device --cases timed ;;
    window)  # not in DEFAULT_PLAN until a GPU has timed it: name it (e.g. window:120)
      for p in 4 20; do
        timeout "$((seconds / 2))" python3 benchmarks/kernels.py --num_pseudo "$p" --layers window_iha \
          --impls pallas_gpu_window,pallas_gpu,cudnn
      done ;;
    kernels*)
      timeout "$seconds" python3 benchmarks/kernels.py --num_pseudo "${stage#kernels}" ;;
    train|train_nosegs)
      timeout "$seconds" python3 benchmarks/train_step.py --steps 10 \
        --configs configs/iha_350m.py,configs/mha_350m.py \
        $([ "$stage" = train_nosegs ] && echo --no_segments) ;;
    train_pallas)  # the IHA step with every layer on the Pallas flash kernels (packed data)
      timeout "$seconds" python3 benchmarks/train_step.py --steps 10 \
        --configs configs/iha_350m.py --implementation pallas_gpu ;;
    *) echo "unknown stage $stage"; return 2 ;;
  esac
}

for spec in "$@"; do
  stage=${spec%%:*}
  seconds=300
  [ "$spec" != "$stage" ] && seconds=${spec#*:}
  echo "=== $stage (limit ${seconds}s) $(date +%T)"
  run_stage "$stage" "$seconds" 2>&1 | tee "$OUT/$stage.log" | grep -v "^\s*$" | tail -n 60
  echo "=== $stage exit ${PIPESTATUS[0]} $(date +%T)"
done
