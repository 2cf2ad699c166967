# thd-kernels: every target runs one documented command; `make help` lists them.
VENV        ?= .venv
VENV36      ?= .venv-triton36
PY          := $(VENV)/bin/python
GPU_PY      ?= python3
# GPU suites in parallel pytest workers where the machine has pytest-xdist (the kernel compiles dominate
# and share Triton's on-disk cache); GPU_WORKERS=0 runs them in one process. pytest-benchmark, where
# installed, is off: its xdist warning would be an error under filterwarnings.
GPU_WORKERS ?= 8
GPU_XDIST    = $(if $(filter-out 0,$(GPU_WORKERS)),$(shell $(GPU_PY) -c 'import xdist' >/dev/null 2>&1 && echo "-n $(GPU_WORKERS) -p no:benchmark"))
PYTEST_ARGS ?=
TORCH_PIN   ?= torch==2.13.0
RELEASE_DEPS := packaging==26.4 build==1.6.1 "wheel>=0.48" "setuptools>=75.8.1" isal==1.9.1
TEST_DEPS    := $(TORCH_PIN) triton==3.9.0 numpy pytest pytest-xdist hypothesis ruff \
                installer check-wheel-contents twine jsonschema transformers==5.17.0
OUTDIR      ?= dist
DEV_OUTDIR  ?= dist-dev
SHORT_SHA   := $(shell git rev-parse --short HEAD 2>/dev/null)

.PHONY: help setup setup-release test test-gpu test-gpu-gluon memcheck test-dist wheel release verify bench bench-cpu lint fmt clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.stamp-release: Makefile
	@echo "==> creating $(VENV) with the release tool's dependencies (packaging, build, wheel, setuptools, isal)"
	python3 -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check --progress-bar off $(RELEASE_DEPS)
	touch $@

$(VENV)/.stamp-full: $(VENV)/.stamp-release pyproject.toml
	@echo "==> installing the CPU test stack into $(VENV): torch, triton, transformers, pytest, ..."
	@echo "    (once per fresh checkout; about 2.5 minutes on 2 cores, then the tests take about 13 minutes)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar off $(TEST_DEPS)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# Triton 3.6 (what the GPU machine runs), no torch: the Gluon kernels' sm_90 compile tests use it.
$(VENV36)/.stamp: Makefile
	@echo "==> creating $(VENV36) with triton==3.6.0 (sm_90 compile checks of the Gluon kernels)"
	python3 -m venv $(VENV36)
	$(VENV36)/bin/python -m pip install -q --disable-pip-version-check --progress-bar off triton==3.6.0
	touch $@

setup-release: $(VENV)/.stamp-release ## light venv for the release tool (no torch)

setup: $(VENV)/.stamp-full $(VENV36)/.stamp ## full venv: pinned CPU torch, triton (interpreter), test tools; triton 3.6 venv

test: setup ## all CPU tests (Triton interpreter, gloo; Gluon compiled for sm_90 on triton 3.9 and 3.6), as CI runs them
	TRITON_INTERPRET=1 THD_TRITON36_PYTHON=$(CURDIR)/$(VENV36)/bin/python $(PY) -m pytest -q -n 2 -m "not gpu" $(PYTEST_ARGS) tests

test-gpu: ## GPU tests on a CUDA machine (machine's python3; FA4 oracle if on PYTHONPATH); then attention with THD_AUTOTUNE=1
	THD_AUTOTUNE=0 PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider $(GPU_XDIST) --ignore=tests/release -k "not autotuned" $(PYTEST_ARGS) tests; default_tiles=$$?; \
	THD_AUTOTUNE=1 PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider -k "autotuned or benchmark_shapes" $(PYTEST_ARGS) tests/ops/test_attention_gpu.py; autotuned=$$?; \
	$(MAKE) --no-print-directory test-gpu-gluon; gluon=$$?; \
	test $$default_tiles -eq 0 && test $$autotuned -eq 0 && test $$gluon -eq 0
test-gpu-gluon: ## the attention, ring and integration GPU tests again with THD_KERNELS=prefer-gluon (Gluon wherever it runs the call)
	THD_KERNELS=prefer-gluon THD_AUTOTUNE=0 PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider $(GPU_XDIST) -k "not autotuned" $(PYTEST_ARGS) tests/ops tests/cp tests/integrations

wheel: setup-release ## dev wheel of the default flavor (+g<sha> local label), verified, in dist-dev/
	$(PY) -m release wheel --outdir $(DEV_OUTDIR) $(if $(SHORT_SHA),--local g$(SHORT_SHA))

release: setup-release ## the full verified release set in dist/ (OVERWRITE=1 replaces a previous one)
	$(PY) -m release release --outdir $(OUTDIR)/ $(if $(OVERWRITE),--overwrite)

test-dist: setup-release ## verify every wheel of the release set in dist/ in release mode (after make release)
	@test -f $(OUTDIR)/release.json || { echo "ERROR: no release set in $(OUTDIR)/; run 'make release' first" >&2; exit 1; }
	$(PY) -m release verify --release $(OUTDIR)/*.whl

verify: setup-release ## verify WHEEL=path
	$(PY) -m release verify $(WHEEL)

memcheck: ## attention kernels on invalid layouts under compute-sanitizer memcheck (GPU machine)
	PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} compute-sanitizer --tool memcheck --error-exitcode 1 \
		$(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_attention_bounds.py

bench: ## GPU benchmarks -> benchmarks/results/*.json (run on the H200; BENCH_ARGS=--quick for a smoke run)
	PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) benchmarks/run_all.py --out benchmarks/results $(BENCH_ARGS)

TE_WHEEL    := benchmarks/.wheels/transformer_engine_cu12-2.20.2-py3-none-manylinux_2_28_x86_64.whl

bench-cpu: setup ## CPU benchmarks (repack of the real 729 MB TE wheel, fetched once) -> benchmarks/results/repack.json
	@test -f $(TE_WHEEL) || $(PY) -m pip download --no-deps --only-binary :all: transformer-engine-cu12==2.20.2 -d benchmarks/.wheels
	$(PY) benchmarks/repack.py --out benchmarks/results/repack.json

lint: setup ## ruff check + format check (read-only)
	$(PY) -m ruff check src release tests benchmarks
	$(PY) -m ruff format --check src release tests benchmarks

fmt: setup ## ruff format + fix
	$(PY) -m ruff format src release tests benchmarks
	$(PY) -m ruff check --fix src release tests benchmarks

clean: ## remove build outputs (keeps .venv)
	rm -rf build dist dist-dev src/*.egg-info .pytest_cache .ruff_cache
