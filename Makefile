# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: demo test test-all test-floor lint bench gpu-check notebooks docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e ".[dev,flower]"
	touch $@ $(VENV)/.installed

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e ".[docs]"
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/python -m experiments.demo

# pytest-xdist runs the tests on PYTEST_WORKERS processes (2: this project's 2-core machines; 0 runs them in
# this process). Whole test files go to one worker (--dist loadfile), so a module's compiled programs are
# shared by its tests.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
PYTEST := $(BIN)/python -m pytest $(XDIST)

# The suite without the tests marked slow (notebook executions, README examples, benchmark scripts, real
# data, paper-scale traces, multi-process runs): at most 10 minutes from a fresh clone with an empty
# compilation cache on 2 cores.
#
# It compiles with LLVM's optimisation off (--xla_backend_optimization_level=0): most of its time is XLA
# compiling small programs that run once (measured from a fresh clone: 6 min 54 s for 1,165 tests, and 8 min 57 s
# in an earlier run, against 11 min 3 s for 1,074 at the default level). A program compiled at -O0 is another compiled program: its
# floats may differ from the optimised one's in the last places (one BPC-FL upload value by 3 ULP), which
# is why tests compare across programs within a few ULP and bit for bit only within one. `make test-all`
# runs every test, these included, at XLA's default level, so CI checks both.
#
# It also compiles with XLA's CPU loop emitters instead of its newer fusion emitters
# (--xla_cpu_use_fusion_emitters=false): from a fresh clone on 2026-11-27's machine the same 1,338 tests took
# 7 min 33 s (748 s CPU) against 13 min 18 s (1,382 s CPU) with -O0 alone. Fused differently, two compiled programs
# that agree bit for bit with the default emitters (FedPA's burn-in round and FedAvg's, the BICompFL hybrid
# and pure SplitDL, an LRSUQ decoder and its encoder within 4 ULP) differed by ULPs in six tests; those
# tests are marked slow, so `make test-all` checks them with the default emitters.
O0_COMPILE := --xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0
FAST_COMPILE := $(O0_COMPILE) --xla_cpu_use_fusion_emitters=false
test: $(VENV)/.installed-dev
	XLA_FLAGS="$(FAST_COMPILE)" $(PYTEST) -m "not slow"

# Every test, the slow ones included (CI runs it after `make test`), in two runs: every test but the breadth
# sweeps at XLA's default level (the programs users run), then the breadth sweeps (one property over every
# algorithm, marker `breadth`) at -O0 with XLA's default emitters. A sweep checks the property of its fast
# siblings, which run at the default level in the first run; compiling two dozen algorithms' rounds is
# most of a sweep's time, about twice as long at the default level as at -O0 (3,043 s against 1,467 s).
test-all: $(VENV)/.installed-dev
	$(PYTEST) -m "not breadth"
	XLA_FLAGS="$(O0_COMPILE)" $(PYTEST) -m breadth

# The declared minimum versions of the jax family (.ci/floor-requirements.txt) in their own environment,
# on the library's fast tests: the tests of the sidejax package (not of experiments/, the notebooks or the
# README), compiled at -O0 (the fusion-emitter flag of `make test` may be unknown to the oldest XLA).
FLOOR_TESTS := tests/algorithms tests/bayes tests/coding tests/data tests/fl tests/models \
  tests/test_bits.py tests/test_blocks.py tests/test_distributions.py tests/test_keys.py \
  tests/test_lattices.py tests/test_layers.py tests/test_layout.py tests/test_metrics.py tests/test_privacy.py
FLOOR := .venv-floor
$(FLOOR)/.installed: pyproject.toml .ci/floor-requirements.txt
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip
	$(FLOOR)/bin/python -m pip install -q -c .ci/floor-requirements.txt -e ".[dev]"
	touch $@

test-floor: $(FLOOR)/.installed
	XLA_FLAGS="$(O0_COMPILE)" $(FLOOR)/bin/python -m pytest $(XDIST) -m "not slow" $(FLOOR_TESTS)

# Re-execute the notebooks in place so their committed outputs (plots, tables) match the code.
# The documentation site (mkdocs.yml, docs/hooks.py) into site/: the README, the guide, the papers' pages,
# the notebooks with their stored outputs, the architecture, the API reference from the docstrings. Every
# warning (a broken link, anchor or cross-reference, a documented parameter that is not in the signature)
# fails the build; CI runs it.
docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs build --strict

notebooks: $(VENV)/.installed-dev
	$(BIN)/python -m experiments.refresh_notebooks

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check sidejax experiments tests

bench: $(VENV)/.installed
	$(BIN)/python -m experiments.bench.local_training

# On a machine with an accelerator (after `.venv/bin/python -m pip install -e ".[cuda]"`), at most 8 minutes:
# the accelerator-relevant tests, 2 rounds of each paper's paper-scale preset on synthetic data of the real
# shapes, and the benchmarks; timings and peak device memory in results/gpu_check/gpu_check.json.
# GPU_CHECK_FLAGS passes options, e.g. GPU_CHECK_FLAGS=--overwrite.
gpu-check: $(VENV)/.installed-dev
	$(BIN)/python -m experiments.gpu_check $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) $(FLOOR) results site .pytest_cache .ruff_cache
