# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: demo test test-fast test-floor lint bench notebooks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e ".[dev]"
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/python -m experiments.demo

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest

# The declared minimum versions of the jax family (.ci/floor-requirements.txt) in their own environment,
# on the library's fast tests.
FLOOR := .venv-floor
$(FLOOR)/.installed: pyproject.toml .ci/floor-requirements.txt
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip
	$(FLOOR)/bin/python -m pip install -q -c .ci/floor-requirements.txt -e ".[dev]"
	touch $@

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -m pytest -m "not slow" --ignore=tests/test_notebooks.py --ignore=tests/test_readme.py

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -m "not slow"

# Re-execute the notebooks in place so their committed outputs (plots, tables) match the code.
notebooks: $(VENV)/.installed-dev
	$(BIN)/python -m experiments.refresh_notebooks

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check sidejax experiments tests

bench: $(VENV)/.installed
	$(BIN)/python -m experiments.bench.local_training

clean:
	rm -rf $(VENV) $(FLOOR) results .pytest_cache .ruff_cache
