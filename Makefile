# Newcomer entry points. `make test` and `make train` build .venv from
# requirements.txt on first use (a fresh machine needs only python3 + venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdirs/default
TEST_MINUTES ?= 17

.PHONY: test test-fast train bench clean-venv

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# The whole suite on CPU (Pallas kernels in interpret mode), one worker per core.
test: $(VENV)/.installed
	@echo "make test: about $(TEST_MINUTES) min on a 2-core CPU (measured); progress in % below"
	$(PY) -m pytest -n auto -q

# The default training demo, then its evaluation and its pictures (the retrieval length
# sweep, layer 0's pseudo-head attention maps) in WORKDIR/pictures.
train: $(VENV)/.installed
	$(PY) train.py --config configs/default.py --workdir $(WORKDIR)
	$(PY) eval.py --workdir $(WORKDIR)
	$(PY) eval.py --workdir $(WORKDIR) --sweep_lengths=64,128,256 --attention_layer=0 \
	  --out_dir $(WORKDIR)/pictures

bench: $(VENV)/.installed
	$(PY) benchmarks/attention.py

clean-venv:
	rm -rf $(VENV)
