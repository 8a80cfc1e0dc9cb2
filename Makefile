# The contract's set-up targets (see CONTRACT.md in the shared folder).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup kernels demo test lint bench-runtime clean

setup: $(STAMP) kernels

# The C++ CPU kernels, compiled once per machine into the user cache (a minute or two on 2 cores);
# afterwards this only finds them.
kernels: $(STAMP)
	@$(VENV)/bin/python -m specextend.kernels

# Re-install only when the dependency pins change; otherwise `make setup` returns at once.
$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/specextend demo

test: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/python -m pytest -q -rs tests

lint: setup
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
