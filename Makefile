# `make demo` and `make test` each work on a fresh clone: they create the virtualenv, install the
# package (torch pinned to the CPU build that lies on these machines' disk), build the plugin's
# CPU twin, then run.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup plugin demo test test-slow hf-zoo lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(STAMP)

# The CPU twin (always), its sanitizer driver, the CUDA objects when nvcc is present, the TensorRT
# glue when its headers are found; see `rope-export build-plugin --help`.
plugin: setup
	$(PY) -m rope_export.cli build-plugin --werror

demo: setup plugin
	$(VENV)/bin/rope-export demo

lint: setup
	$(VENV)/bin/ruff check rope_export tests scripts models

test: lint plugin
	$(PY) -m pytest -q

# The tests marked slow: most of the transformers zoo (tests/hf/test_hf_zoo.py) and the rest of
# the RoPE block zoo through export_module and fuse.
test-slow: setup plugin
	$(PY) -m pytest -q -m slow

# Re-record every zoo type (tests/hf/hf_zoo_results.json) and re-render the README's zoo table.
hf-zoo: setup plugin
	rm -f build/hf_zoo.jsonl && mkdir -p build
	HF_ZOO_RECORD=build/hf_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/hf/test_hf_zoo.py || true
	$(PY) tests/hf/hf_zoo_table.py build/hf_zoo.jsonl

clean:
	rm -rf $(VENV) build out .pytest_cache .ruff_cache .hypothesis
