# Two entry points (see README): `make demo` (main job) and `make test` (the test suite).
# Both create .venv on first use. The venv sees the system's site-packages, so a torch that is
# already installed (for example a CUDA build on a GPU node) is kept; otherwise torch 2.13.0 is
# installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NVCC ?= nvcc
# The extension's targets (mok.spec.arch.BUILD_TARGETS): Hopper, B200 / GB200, GB300.
CUDA_ARCHS ?= 90a 100a 103a
CU_SOURCES := $(shell find csrc -name '*.cu' 2>/dev/null | sort)
# The transformers release the hf extra's tests (tests/test_integrations_hf.py) run against.
TRANSFORMERS ?= 5.17.0

.PHONY: setup demo test lint pytest cuda-check clean

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev,notebooks,hf]" "transformers==$(TRANSFORMERS)"
	touch $@

# The demo's chart goes under build/ (git-ignored), not into the checkout's root.
DEMO_PNG ?= build/mok-sim-default.png

demo: setup
	mkdir -p $(dir $(DEMO_PNG))
	$(BIN)/mok-sim --out $(DEMO_PNG)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

pytest: setup
	$(BIN)/python -m pytest -q

cuda-check:
	@if [ -z "$(CU_SOURCES)" ]; then echo "cuda-check: no .cu files under csrc/"; exit 0; fi; \
	if ! command -v $(NVCC) >/dev/null; then \
	  if [ -n "$$CI" ]; then echo "cuda-check: nvcc not found and CI is set: CI must compile csrc/"; exit 1; fi; \
	  echo "cuda-check: skipped, nvcc not found (set NVCC=/path/to/nvcc to compile-check csrc/)"; exit 0; \
	fi; \
	tmp=$$(mktemp -d); \
	for arch in $(CUDA_ARCHS); do for f in $(CU_SOURCES); do \
	  echo "nvcc sm_$$arch $$f"; \
	  $(NVCC) -std=c++17 -O1 -Icsrc $(NVCC_FLAGS) -gencode=arch=compute_$$arch,code=sm_$$arch \
	    -c $$f -o $$tmp/$$(basename $$f).$$arch.o > $$tmp/log 2>&1; rc=$$?; cat $$tmp/log; \
	  [ $$rc -eq 0 ] || exit 1; \
	  if grep -qE 'C751[15]' $$tmp/log; then \
	    echo "cuda-check: ptxas serialises wgmma in $$f (C7515: accumulators written by non-wgmma code; C7511: too few registers)"; exit 1; \
	  fi; \
	done; done; rm -rf $$tmp

test: lint cuda-check pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
