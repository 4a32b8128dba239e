# The README's Quick start: each target does all the set-up it needs on a fresh machine (a venv in .venv, torch,
# plait), then runs. Idempotent: a second call installs nothing unless pyproject.toml changed. No sudo.
#   make demo   set up, then `plait train` on the built-in demo
#   make test   set up with the test extras, then the test suite (what .ci/run calls)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines take torch's CPU build from PyTorch's own index (PyPI's Linux torch is the CUDA build, GBs more),
# alone (--no-deps: that index is asked for torch only), then its dependencies from PyPI; with an NVIDIA driver,
# plain PyPI's CUDA build comes in with plait.
TORCH := "torch==2.13.0"
TORCH_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: demo test setup setup-dev
demo: setup
	$(BIN)/plait train

test: setup-dev
	$(BIN)/python -m pytest -q

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "NVIDIA driver found: torch comes from PyPI (CUDA build)"; \
	else $(BIN)/pip install -q --no-deps $(TORCH) --index-url $(TORCH_INDEX) && $(BIN)/pip install -q $(TORCH); fi

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(VENV)/.installed
