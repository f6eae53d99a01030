# Newcomer entry points. `make test` and `make train` build .venv from
# requirements.txt on first use (a fresh machine needs only python3 + venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdirs/default
TWIN_WORKDIR ?= workdirs/global_local_default
TEXT_WORKDIR ?= workdirs/text_iha
TEXT_TWIN_WORKDIR ?= workdirs/text_global_local
TEXT_DATA ?= workdirs/data
TEXT_TOKENIZER := $(TEXT_DATA)/tokenizers/python_stdlib-chunks-bpe2048.json
TEST_MINUTES ?= 10-25
# The targets' compilers (libtpu; the CUDA plugin + ptxas), outside the CPU venv so that
# CPU runs never load them: compile checks put one directory on sys.path when asked.
TARGETS_DIR ?= .targets

.PHONY: test lint format train train-text bench targets compile-matrix clean-venv gpu-wheels

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(TARGETS_DIR)/.installed: requirements-targets-tpu.txt requirements-targets-cuda.txt $(VENV)/.installed
	rm -rf $(TARGETS_DIR)/tpu $(TARGETS_DIR)/cuda
	$(PY) -m pip install --quiet --no-deps --target $(TARGETS_DIR)/tpu -r requirements-targets-tpu.txt
	$(PY) -m pip install --quiet --no-deps --target $(TARGETS_DIR)/cuda -r requirements-targets-cuda.txt
	touch $@

# Compile-only TPU and H100 targets (`train.py --compile_only`, benchmarks/compile_matrix.py).
targets: $(TARGETS_DIR)/.installed

# The whole suite on CPU (Pallas kernels in interpret mode, plus a few compiles for TPU and
# H100 by their own compilers), one worker per core.
test: $(VENV)/.installed $(TARGETS_DIR)/.installed
	@echo "make test: about $(TEST_MINUTES) min on a 2-core CPU (measured); progress in % below"
	IHA_REQUIRE_TARGETS=1 $(PY) -m pytest -n auto -q

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
	$(PY) benchmarks/compile_matrix.py --out docs/compile_matrix.md

clean-venv:
	rm -rf $(VENV)

# Wheels for a lent GPU machine (Python 3.12, no registry): benchmarks/gpu_session.sh
# installs what .whl/ holds. promise has no wheel: built here (pure Python).
GPU_WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels: $(VENV)/.installed
	grep -v '^promise' requirements-gpu-machine.txt | $(PY) -m pip download --quiet --no-deps \
	  --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_WHEEL_PLATFORMS) \
	  -d .whl -r /dev/stdin
	$(PY) -m pip wheel --quiet --no-deps -w .whl $$(grep '^promise' requirements-gpu-machine.txt)
