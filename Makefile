# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/cpu_default.toml
ARGS ?=

.PHONY: run test lint venv dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null

# The stamp files re-install only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e . 
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(BIN)/megascale train --config $(CONFIG) $(ARGS)

test: $(VENV)/.installed-dev
	$(BIN)/ruff check megascale tests benchmarks
	$(BIN)/python -m pytest $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check megascale tests benchmarks

clean:
	rm -rf $(VENV) runs data/cache
