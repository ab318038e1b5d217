# Every target installs what it needs into .venv first (torch pinned to the CPU/CUDA-agnostic 2.13.0 wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TASK ?= listops_gen
ARGS ?=

.PHONY: help venv train test test-fast test-gpu data sweep bench lint clean-venv

help:
	@echo "make train            train the embedded default (experiment=quickstart); ARGS='key=value ...' to override"
	@echo "make test             run the whole test suite (CI; CPU, Triton kernels under the interpreter)"
	@echo "make test-fast        the quick tier: everything not marked slow (about 4 minutes on 2 cores)"
	@echo "make test-gpu         the tests marked gpu, with compiled Triton kernels (needs a CUDA GPU)"
	@echo "make data TASK=name   download / generate / verify one task's data (listops, text, pathfinder_gen, ...)"
	@echo "make sweep            an example multi-run: quickstart over three seeds"
	@echo "make bench            model-level and kernel benchmarks (needs a CUDA GPU for the kernel numbers)"
	@echo "make lint             ruff (rules in pyproject.toml) and the import-layering test"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m longmixer.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow" --durations=15 $(ARGS)

test-gpu: $(STAMP)
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu $(ARGS)

data: $(STAMP)
	$(PY) scripts/prepare_data.py $(TASK) $(ARGS)

sweep: $(STAMP)
	$(PY) -m longmixer.train -m experiment=quickstart seed=0,1,2 $(ARGS)

bench: $(STAMP)
	$(PY) -m longmixer.bench $(ARGS)
	for f in scripts/bench/[a-z]*.py; do PYTHONPATH=src $(PY) $$f || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layering.py

clean-venv:
	rm -rf $(VENV)
