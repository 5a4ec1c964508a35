# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/cpu_default.toml
ARGS ?=

.PHONY: run test lint venv dev clean redis chromium iproute2

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null

# The stamp files re-install only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e . 
	touch $@

# Megatron-Core writes the Megatron-format datasets the tests read (tests/test_data_formats.py). It comes
# without dependencies, so pip never reconsiders the pinned torch: what its dataset module imports
# (torch, numpy, packaging, PyYAML) is installed by the lines above.
MEGATRON_CORE := megatron-core==0.16.1

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps $(MEGATRON_CORE)
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(BIN)/megascale train --config $(CONFIG) $(ARGS)

# The Redis store's tests run a real redis-server (Debian's package; CI is a clean Debian 12, as root).
# The package lists are refreshed only when the install fails without them.
redis:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y redis-server || \
	  { $$SUDO apt-get update && $$SUDO apt-get install -y redis-server; }; }

# The report's test opens the page in headless Chromium (Debian's package), the same way.
chromium:
	@command -v chromium >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y chromium || \
	  { $$SUDO apt-get update && $$SUDO apt-get install -y chromium; }; }

# The simulated cluster (megascale/fault/netns.py) makes hosts of network namespaces with iproute2's `ip`
# and shapes links with its `tc`.
iproute2:
	@command -v ip >/dev/null && command -v tc >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y iproute2 || \
	  { $$SUDO apt-get update && $$SUDO apt-get install -y iproute2; }; }

test: $(VENV)/.installed-dev redis chromium iproute2
	$(BIN)/ruff check megascale tests benchmarks
	$(BIN)/python -m pytest $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check megascale tests benchmarks

clean:
	rm -rf $(VENV) runs data/cache
