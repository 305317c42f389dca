# The two commands of the README. Each creates .venv and installs what it needs on its own.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned before the package so pip never picks a newer multi-GB build by itself: on machines
# without a GPU pip's configuration here serves the CPU build of 2.13.0 from local disk; elsewhere the
# same release comes from PyPI (the CUDA build on Linux).
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: serve test lint bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

serve: $(VENV)/.installed
	$(BIN)/localserve serve $(ARGS)

# pytest's own script, not `python -m pytest`, which would put this folder (kernels/, models/, tui/) first on
# sys.path while pytest loads its plugins; the first line pytest prints is the versions it runs with.
test: $(VENV)/.installed
	@$(BIN)/pytest -q --durations=25 $(ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check .

# One benchmark from a fresh checkout: `make bench NAME=throughput ARGS="--requests 64"` runs
# scripts/bench_throughput.py (NAME=profile_step runs scripts/profile_step.py).
NAME ?= throughput
$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test,bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python scripts/$(if $(filter profile_step,$(NAME)),$(NAME),bench_$(NAME)).py $(ARGS)
