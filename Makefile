# opfuse: the two README commands (`make demo`, `make test`) set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first, so pip does not pull a multi-GB CUDA build to satisfy
# `torch>=2.11`: from wherever pip already looks (the CI/dev machines keep this wheel on disk),
# else from PyTorch's CPU index. Set TORCH_PIN= (empty) to keep pip's default choice.
TORCH_VERSION ?= 2.13.0
TORCH_PIN ?= torch==$(TORCH_VERSION)+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NVCC ?= nvcc
export OMP_NUM_THREADS ?= 1

.PHONY: all venv test test-unit test-dist test-gpu demo dump doctor build check-cuda check-imports clean

all: test

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_PIN)" ] && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install -q "$(TORCH_PIN)" 2>/dev/null || \
		{ echo "installing $(TORCH_PIN) from $(TORCH_CPU_INDEX)"; \
		  $(PY) -m pip install -q "$(TORCH_PIN)" --extra-index-url "$(TORCH_CPU_INDEX)"; }; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.stamp

test: venv check-cuda check-imports
	$(PY) -m pytest -q tests

test-unit: venv
	$(PY) -m pytest -q tests/unit

test-dist: venv
	$(PY) -m pytest -q tests/dist

test-gpu:
	PYTHONPATH=. $(PYTHON) -m pytest -q tests/gpu

demo: venv
	$(PY) -m opfuse demo

dump: venv
	$(PY) -m opfuse dump

doctor: venv
	$(PY) -m opfuse doctor

# Build the CUDA extension ahead of first use (GPU hosts; uses the torch in $(PYTHON)).
build:
	PYTHONPATH=. $(PYTHON) -m opfuse.runtime.extension --build

# Compile every CUDA source without a GPU (runs in CI when nvcc is present; skipped otherwise).
check-cuda: venv
	@if command -v $(NVCC) >/dev/null 2>&1; then \
		$(PY) -c "import pybind11" 2>/dev/null || $(PY) -m pip install -q -e ".[cuda]"; \
		$(PY) tools/check_cuda.py --nvcc $$(command -v $(NVCC)); \
	else \
		echo "check-cuda: nvcc not found, skipped"; \
	fi

# No import cycles inside the package, and imports that go down the layers (docs/ARCHITECTURE.md),
# deferred imports included.
check-imports: venv
	$(PY) tools/import_cycles.py
	$(PY) tools/layers.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache tools/browser/node_modules
