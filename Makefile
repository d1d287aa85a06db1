# `make demo` and `make test` each work on a fresh clone: they create the virtualenv, install the
# package (torch pinned to the CPU build that lies on these machines' disk), build the plugin's
# CPU twin, then run.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup plugin demo test test-slow lint clean

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

# the tests marked slow (the whole block zoo through export_module and fuse at both opsets)
test-slow: setup plugin
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) build out .pytest_cache .ruff_cache .hypothesis
