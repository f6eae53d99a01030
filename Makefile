# Newcomer entry points. `make test` and `make train` build .venv from
# requirements.txt on first use (a fresh machine needs only python3 + venv).
# Two dependency sets, both tested by CI: SET=pinned (the default: requirements.txt,
# Python 3.11, jax 0.10.2) and SET=newest (requirements-newest.txt, Python 3.12, jax
# 0.12), each in its own venv and compile packages; e.g. `make train SET=newest`.
SET ?= pinned
ifeq ($(SET),newest)
# python3.12 on PATH, else pyenv's newest 3.12 (installed there but not on PATH here);
# `:=`, not `?=`: an environment's PYTHON (another version) must not win, a command line's does.
PYTHON := $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || \
  ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -1)
VENV ?= .venv-newest
TARGETS_DIR ?= .targets-newest
SUFFIX := -newest
else ifeq ($(SET),pinned)
PYTHON ?= python3
VENV ?= .venv
SUFFIX :=
else
$(error SET=$(SET): pinned (requirements.txt) or newest (requirements-newest.txt))
endif
REQUIREMENTS := requirements$(SUFFIX).txt
PY := $(VENV)/bin/python
WORKDIR ?= workdirs/default
TWIN_WORKDIR ?= workdirs/global_local_default
TEXT_WORKDIR ?= workdirs/text_iha
TEXT_TWIN_WORKDIR ?= workdirs/text_global_local
TEXT_DATA ?= workdirs/data
TEXT_TOKENIZER := $(TEXT_DATA)/tokenizers/python_stdlib-chunks-bpe2048.json
TEST_MINUTES ?= 10
# The targets' compilers (libtpu; the CUDA plugin + ptxas), outside the CPU venv so that
# CPU runs never load them: compile checks put one directory on sys.path when asked.
TARGETS_DIR ?= .targets

.PHONY: test test-rest test-all test-durations mutants test-newest test-boundaries lint format \
  train train-text bench targets compile-matrix clean-venv gpu-wheels

$(VENV)/.installed: $(REQUIREMENTS) pyproject.toml
	@test -n "$(PYTHON)" || { echo "SET=$(SET) needs Python 3.12 (jax 0.11+ requires it):" \
	  "put python3.12 on PATH or pass PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r $(REQUIREMENTS)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

TARGET_REQUIREMENTS := requirements-targets-tpu$(SUFFIX).txt requirements-targets-cuda$(SUFFIX).txt
$(TARGETS_DIR)/.installed: $(TARGET_REQUIREMENTS) $(VENV)/.installed
	rm -rf $(TARGETS_DIR)/tpu $(TARGETS_DIR)/cuda
	$(PY) -m pip install --quiet --no-deps --target $(TARGETS_DIR)/tpu -r $(word 1,$(TARGET_REQUIREMENTS))
	$(PY) -m pip install --quiet --no-deps --target $(TARGETS_DIR)/cuda -r $(word 2,$(TARGET_REQUIREMENTS))
	touch $@

# Compile-only TPU and H100 targets (`train.py --compile_only`, benchmarks/compile_matrix.py).
targets: $(TARGETS_DIR)/.installed

# The suite on CPU (Pallas kernels in interpret mode, plus a TPU and an H100 compile by
# their own compilers), one worker per core, longest modules first (tests/conftest.py); the
# 15 slowest tests are listed at the end. `make test` runs every implementation against the
# reference per kind and mask class, the layers, training with checkpoints, decoding,
# sharding and the docs' examples, and kills every mutant of `make mutants`; the tests marked
# `full` (the rest of the matrices, the studies at tiny scale, every compile) run in
# `make test-rest`, and both in `make test-all` (CI runs test, test-rest and test-newest).
PYTEST := IHA_TARGETS_DIR=$(abspath $(TARGETS_DIR)) IHA_REQUIRE_TARGETS=1 $(PY) -m pytest \
  -n auto -q --maxschedchunk 2
test: $(VENV)/.installed $(TARGETS_DIR)/.installed
	@echo "make test: about $(TEST_MINUTES) min on a 2-core CPU (measured); progress in % below"
	$(PYTEST) -m "not full" --durations=15

test-rest: $(VENV)/.installed $(TARGETS_DIR)/.installed
	$(PYTEST) -m full --durations=15

test-all: $(VENV)/.installed $(TARGETS_DIR)/.installed
	$(PYTEST) --durations=15

# Rewrites tests/durations.json (the order tests run in) from a whole run.
test-durations: $(VENV)/.installed $(TARGETS_DIR)/.installed
	IHA_RECORD_DURATIONS=1 $(PYTEST) -p no:cacheprovider

# Applies each planted bug of tests/mutants.py to a scratch copy and runs `make test` on it
# until its first failure, leaving out the tests that fail on an unmutated copy (a control
# run first); fails if a mutant survives (docs/testing.md has the table).
mutants: $(VENV)/.installed $(TARGETS_DIR)/.installed
	$(PY) tests/mutants.py

# The newest set (SET=newest) through every package boundary, as CI runs it: kernels
# interpreted and lowered, nn, models, train step, checkpoint restore, decoding, context
# parallelism, and the TPU and H100 compile checks (227 tests, about 10 min on a 2-core
# machine, plus installs from pip's cache). `make test-all SET=newest` runs the whole suite.
BOUNDARY_TESTS ?= tests/test_dependencies.py tests/kernels/test_kernels.py tests/kernels/test_export.py \
  tests/nn/test_layers.py tests/models/test_models.py tests/train/test_step.py tests/models/test_decode.py \
  tests/parallel/test_context.py tests/kernels/test_compile_targets.py \
  tests/train/test_train.py::test_resume_reproduces_uninterrupted_run \
  tests/train/test_train.py::test_restore_onto_another_mesh
test-newest:
	$(MAKE) --no-print-directory SET=newest test-boundaries

test-boundaries: $(VENV)/.installed $(TARGETS_DIR)/.installed
	$(PY) --version
	$(PY) -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)'
	$(PYTEST) $(BOUNDARY_TESTS)

# Style (pyproject.toml): ruff's lint rules, and ruff format's 2-space, 100-column layout;
# the import layers of docs/design.md §8 (import-linter's contract in pyproject.toml).
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-logo --no-cache

format: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# The default training demo: IHA ("LM") and its Global+Local twin ("SM"), each at its own
# tuned learning rate, evaluated side by side; then the retrieval length sweep of both
# and the attention maps of their first layer (layer number 1) in WORKDIR/pictures.
train: $(VENV)/.installed
	$(PY) train.py --config configs/default.py --workdir $(WORKDIR)
	$(PY) train.py --config configs/global_local_default.py --workdir $(TWIN_WORKDIR)
	$(PY) eval.py --workdir $(WORKDIR) --workdir $(TWIN_WORKDIR)
	$(PY) eval.py --workdir $(WORKDIR) --workdir $(TWIN_WORKDIR) --sweep_lengths=64,128,256 \
	  --attention_layer_number=1 --out_dir $(WORKDIR)/pictures

# The corpus every machine has (the interpreter's standard library source, test packages
# excluded) and a 2048-piece byte-level BPE trained on its train split.
$(TEXT_TOKENIZER): | $(VENV)/.installed
	$(PY) -m iha_jax.data.build --name=python_stdlib/chunks --data_dir=$(TEXT_DATA)
	$(PY) -m iha_jax.data.train_tokenizer --name=python_stdlib/chunks --data_dir=$(TEXT_DATA) \
	  --format=tokenizer.json --vocab_size=2048 --output=$(basename $@)

# Language modelling on real text: IHA ("LLLLM") and its Global+Local twin ("SSSSM") on
# the Python standard library for a few minutes each, then their test perplexity and bits
# per byte side by side and a greedy and a sampled completion of a Python prompt from each.
train-text: $(VENV)/.installed $(TEXT_TOKENIZER)
	$(PY) train.py --config configs/text_iha.py --workdir $(TEXT_WORKDIR) \
	  --config.data.data_dir=$(TEXT_DATA) --config.data.tokenizer=$(TEXT_TOKENIZER)
	$(PY) train.py --config configs/text_global_local.py --workdir $(TEXT_TWIN_WORKDIR) \
	  --config.data.data_dir=$(TEXT_DATA) --config.data.tokenizer=$(TEXT_TOKENIZER)
	$(PY) eval.py --workdir $(TEXT_WORKDIR) --workdir $(TEXT_TWIN_WORKDIR) --complete

bench: $(VENV)/.installed
	$(PY) benchmarks/attention.py

# Every kernel configuration compiled for TPU v5e/v5p/v6e and H100 (about an hour here).
compile-matrix: $(TARGETS_DIR)/.installed
	IHA_TARGETS_DIR=$(abspath $(TARGETS_DIR)) $(PY) benchmarks/compile_matrix.py \
	  --out docs/compile_matrix.md

clean-venv:
	rm -rf $(VENV)

# Wheels for a GPU machine (Python 3.12, no registry): benchmarks/gpu_session.sh
# installs what .whl/ holds. promise has no wheel: built here (pure Python).
GPU_WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels: $(VENV)/.installed
	grep -v '^promise' requirements-gpu-machine.txt | $(PY) -m pip download --quiet --no-deps \
	  --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_WHEEL_PLATFORMS) \
	  -d .whl -r /dev/stdin
	$(PY) -m pip wheel --quiet --no-deps -w .whl $$(grep '^promise' requirements-gpu-machine.txt)
