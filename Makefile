# `make demo` and `make test` each work on a fresh clone: they create the virtualenv, install the
# package (torch pinned to the CPU build that lies on these machines' disk), build the plugin's
# CPU twin, then run.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# TensorRT: the headers the plugin libraries are built against (.ci/run points both at
# ../shared/third_party when it is there; empty: no TensorRT plugins, their tests skip), and TensorRT's
# lean runtime from pip (runs without a GPU) for the tests that load the libraries into it: 11.x into
# the venv (extra trt-lean), 10.x into its own folder (same module name).
TENSORRT_INCLUDE_DIR ?=
TENSORRT10_INCLUDE_DIR ?=
TRT_LEAN10_SPEC ?= tensorrt-lean-cu12==10.16.0.72
TRT_LEAN10_DIR := build/trt-lean-10
# Read by `rope-export build-plugin` (also when the tests' scripts call it): one build, both versions.
export TENSORRT_INCLUDE_DIR
export TENSORRT_EXTRA_INCLUDE_DIRS := $(TENSORRT10_INCLUDE_DIR)

.PHONY: setup plugin trt-lean demo test test-slow hf-zoo lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(STAMP)

# The CPU twin (always), its sanitizer driver, the CUDA kernels and library when nvcc is present, the
# TensorRT plugin libraries when its headers are given; see `rope-export build-plugin --help`.
plugin: setup
	$(PY) -m rope_export.cli build-plugin --werror

$(VENV)/.trt-lean: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,trt-lean]'
	touch $@

$(TRT_LEAN10_DIR)/.installed:
	$(PY) -m pip install --quiet --no-warn-script-location --target $(TRT_LEAN10_DIR) '$(TRT_LEAN10_SPEC)'
	touch $@

trt-lean: setup $(if $(TENSORRT_INCLUDE_DIR),$(VENV)/.trt-lean) $(if $(TENSORRT10_INCLUDE_DIR),$(TRT_LEAN10_DIR)/.installed)

demo: setup plugin
	$(VENV)/bin/rope-export demo

lint: setup
	$(VENV)/bin/ruff check rope_export tests scripts models

# Two pytest workers (pytest-xdist): CI has 2 cores, and the suite is mostly one-threaded torch and
# onnxruntime on tiny models (pytest took 15 min in one process here, 8.5 min in two). Each worker
# is one more Python process with torch loaded; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: lint plugin trt-lean
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The tests marked slow, left out of `make test` (minutes; the real-size ones take ~3 GB of memory and
# ~8 GB of free disk in $$TMPDIR): a model past protobuf's 2 GB limit exported, lowered to every target
# and fused; every lowering of every transformers family checked; most of the transformers zoo
# (tests/hf/test_hf_zoo.py) and the rest of the RoPE block zoo through export_module and fuse.
test-slow: setup plugin
	$(PY) -m pytest -q -m slow --durations=0

# Re-record every zoo type (tests/hf/hf_zoo_results.json) and re-render the README's zoo table.
hf-zoo: setup plugin
	rm -f build/hf_zoo.jsonl && mkdir -p build
	HF_ZOO_RECORD=build/hf_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/hf/test_hf_zoo.py || true
	$(PY) tests/hf/hf_zoo_table.py build/hf_zoo.jsonl

clean:
	rm -rf $(VENV) build out .pytest_cache .ruff_cache .hypothesis
