# The two commands a new user needs are `make demo` and `make test` (see README.md).
# Both set everything up first (idempotent: a second run skips what is built).

PYTHON ?= python3
VENV_PY := .venv/bin/python
SETUP_ARGS ?=

.PHONY: setup wheel demo test test-fast test-scalar test-aarch64 test-windows test-vulkan lint patches bench clean

setup:
	$(PYTHON) -m rotaryquant.build setup $(SETUP_ARGS)

# wheels for any Python environment (dist/): the patched llama-cpp-python with our libraries and llama.cpp's
# tools, the patched gguf, rotaryquant; `pip install dist/*.whl` (backend: SETUP_ARGS=--vulkan, as for setup)
wheel:
	$(PYTHON) -m rotaryquant.build wheel $(SETUP_ARGS)

# set-up builds only what the demo runs first (setup --demo); make test builds the rest
demo:
	$(PYTHON) -m rotaryquant.build setup --demo $(SETUP_ARGS)
	$(VENV_PY) -m rotaryquant.demo

test: setup
	$(VENV_PY) -m pytest -q $(PYTEST_ARGS)

# the suite without the slow end-to-end tests (generation, server, backend-ops)
test-fast: setup
	$(VENV_PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# the CPU paths other than build/cpu's AVX2 (docs/cpu-paths.md): a ggml build with
# every x86 SIMD option off (build/scalar), an AArch64 NEON build run under qemu (build/aarch64), and a
# Windows x86-64 build with mingw-w64 run under wine (build/windows)
# ruff with pyproject's rules (also a test in the suite: tests/test_lint.py)
lint: setup
	$(VENV_PY) -m ruff check .

test-scalar: setup
	scripts/ci/scalar.sh

test-aarch64: setup
	scripts/ci/aarch64.sh

test-windows: setup
	scripts/ci/windows.sh

# the Vulkan backend on Mesa's lavapipe (build/vulkan; docs/vulkan.md): our kernels against the CPU, end to end
test-vulkan: setup
	scripts/ci/vulkan.sh $(VULKAN_ARGS)

# KV-cache speed per type and depth: rq-eval bench (minutes on 2 cores; results in docs/results/kv-bench.md)
bench: setup
	$(VENV_PY) -m rotaryquant.eval.cli bench $(BENCH_ARGS)

# write edits made in build/src/llama-cpp-python (committed there) back to ggml-patches/*.patch
patches:
	$(PYTHON) -m rotaryquant.build export-patches

clean:
	rm -rf build .venv
