# Two entry points: `make demo` (install, then run the main job) and `make test` (install, then the tests).
# Everything goes into .venv; torch is pinned to the CPU wheel so a fresh machine never pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.routing --quick

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check moe tests benchmarks
	$(VENV)/bin/ruff format --check moe tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
