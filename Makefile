# Two entry points: `make demo` (install, then run the main job) and `make test` (install, then the tests).
# Everything goes into .venv, made by $(PYTHON) (3.11 or newer). torch is installed first, pinned, from
# whatever index pip is configured with: from the default registry on Linux that is the CUDA build (several
# GB with its nvidia-* packages; on macOS and Windows no CUDA packages). TORCH_INDEX names another index for
# torch alone, e.g. PyTorch's CPU wheels (README.md, "Set up"):
#     make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
TORCH_INDEX ?=
# pytest-xdist workers for `make test`, each taking whole test files (a file's module fixtures run
# once); most tests wait on one single-threaded subprocess, so two workers on two cores halve the time
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_INDEX_ARGS := $(if $(strip $(TORCH_INDEX)),--index-url $(strip $(TORCH_INDEX)))

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "moe needs Python >= 3.11, $(PYTHON) is " + sys.version.split()[0] + ": run make PYTHON=python3.11 (or newer)")'
	@$(PYTHON) -m venv $(VENV) || { echo "$(PYTHON) -m venv failed; on Debian/Ubuntu install the venv module: apt install python3-venv (or python3.11-venv)" >&2; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX_ARGS) torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench,hf,data,log,megatron,torchtitan]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moe train

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check moe tests benchmarks
	$(VENV)/bin/ruff format --check moe tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
