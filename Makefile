# `make demo` and `make test` each work on a fresh clone: they create the virtualenv, install the
# package at the versions of the committed lock (torch: the CPU build that lies on these machines'
# disk), build the plugin's CPU twin, then run. `make lock` re-resolves the lock from the newest
# releases; `make test-latest` runs the suite on the newest releases without it (the drift lane);
# `make test-oldest` on the lower bounds pyproject.toml declares.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# TensorRT: the headers the plugin libraries are built against (include/ of a fetched NVIDIA/TensorRT
# checkout, outside this repository, see docs/tensorrt.md; empty: no TensorRT plugins, their tests skip), and TensorRT's
# lean runtime from pip (runs without a GPU) for the tests that load the libraries into it: 11.x into
# the venv (extra trt-lean), 10.x into its own folder (same module name).
TENSORRT_INCLUDE_DIR ?=
TENSORRT10_INCLUDE_DIR ?=
TRT_LEAN10_SPEC ?= tensorrt-lean-cu12==10.16.0.72
TRT_LEAN10_DIR := build/trt-lean-10
# Read by `rope-export build-plugin` (also when the tests' scripts call it): one build, both versions.
export TENSORRT_INCLUDE_DIR
export TENSORRT_EXTRA_INCLUDE_DIRS := $(TENSORRT10_INCLUDE_DIR)

.PHONY: setup plugin trt-lean demo test test-slow test-latest test-torch test-oldest lock hf-zoo hf-task-zoo hf-zoo-version lint clean vlm-zoo diffusers-zoo

# Every install reads the lock (requirements/lock.txt): a fresh clone next month installs what passed
# today. The build backend comes from the lock too (--no-build-isolation), so nothing unpinned is installed.
$(STAMP): pyproject.toml requirements/lock.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet --constraint requirements/lock.txt "$(TORCH_SPEC)" setuptools
	$(PY) -m pip install --quiet --constraint requirements/lock.txt --no-build-isolation -e '.[dev,serve,diffusers]'
	touch $@

setup: $(STAMP)

# The CPU twin (always), its sanitizer driver, the CUDA kernels and library when nvcc is present, the
# TensorRT plugin libraries when its headers are given; see `rope-export build-plugin --help`. The kernels
# for every architecture by default (CI fails on a register spill in any); CUDA_ARCHS=auto: only this
# machine's GPUs (none without one), CUDA_ARCHS=80,90: those.
CUDA_ARCHS ?= all
plugin: setup
	$(PY) -m rope_export.cli build-plugin --werror --cuda-archs $(CUDA_ARCHS)

$(VENV)/.trt-lean: $(STAMP)
	$(PY) -m pip install --quiet --constraint requirements/lock.txt --no-build-isolation -e '.[dev,serve,diffusers,trt-lean]'
	touch $@

$(TRT_LEAN10_DIR)/.installed: $(STAMP)
	$(PY) -m pip install --quiet --constraint requirements/lock.txt --no-warn-script-location \
		--target $(TRT_LEAN10_DIR) '$(TRT_LEAN10_SPEC)'
	touch $@

# Triton Inference Server's real tritonserver (Python backend only) from the nvidia-pytriton wheel, in a
# folder of its own: its numpy<2 pin must not reach the venv. tests/serve/test_triton.py serves through it.
PYTRITON_SPEC ?= nvidia-pytriton==0.7.0
PYTRITON_DIR := build/pytriton
$(PYTRITON_DIR)/.installed: $(STAMP)
	$(PY) -m pip install --quiet --constraint requirements/lock.txt --no-deps --no-warn-script-location \
		--target $(PYTRITON_DIR) '$(PYTRITON_SPEC)'
	touch $@

trt-lean: setup $(if $(TENSORRT_INCLUDE_DIR),$(VENV)/.trt-lean) $(if $(TENSORRT10_INCLUDE_DIR),$(TRT_LEAN10_DIR)/.installed)

# The demo builds build/plugins itself, once: an existing build is reused as configured, a new one gets the
# CPU twin and CUDA kernels only for this machine's GPUs (none without one; `make plugin` builds them all).
demo: setup
	$(VENV)/bin/rope-export demo

lint: setup
	$(VENV)/bin/ruff check rope_export tests scripts models

# Two pytest workers (pytest-xdist): CI has 2 cores, and the suite is mostly one-threaded torch and
# onnxruntime on tiny models (pytest took 15 min in one process here, 8.5 min in two). Each worker
# is one more Python process with torch loaded; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: lint plugin trt-lean $(PYTRITON_DIR)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The tests marked slow, left out of `make test` (minutes; the real-size ones take ~3 GB of memory and
# ~8 GB of free disk in $$TMPDIR): a model past protobuf's 2 GB limit exported, lowered to every target
# and fused; every lowering of every transformers family checked; most of the transformers zoo
# (tests/hf/test_hf_zoo.py) and the rest of the RoPE block zoo through export_module and fuse.
test-slow: setup plugin
	$(PY) -m pytest -q -m slow --durations=0

# The lock: resolve the newest releases with pip in a throwaway virtualenv, write requirements/lock.txt
# and print what changed. Then run `make test` (it reinstalls from the new lock) before committing it.
lock:
	TORCH_SPEC='$(TORCH_SPEC)' TRT_LEAN10_SPEC='$(TRT_LEAN10_SPEC)' PYTRITON_SPEC='$(PYTRITON_SPEC)' \
		$(PYTHON) scripts/versions.py lock

# The drift lane (not part of `make test`): the newest release of everything, no lock, in its own
# virtualenv; the suite with the quick zoo, then a table of what differs from the lock and what broke.
# Run it weekly (transformers releases about every week) and before `make lock`.
LATEST_VENV ?= .venv-latest
test-latest:
	rm -rf $(LATEST_VENV) && $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" setuptools
	$(LATEST_VENV)/bin/python -m pip install --quiet --no-build-isolation -e '.[dev,serve,diffusers]'
	$(LATEST_VENV)/bin/python -m rope_export.cli build-plugin
	mkdir -p build; status=0; ROPE_EXPORT_NO_LOCK=1 $(LATEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --junitxml build/latest-junit.xml \
		|| status=$$?; $(LATEST_VENV)/bin/python scripts/versions.py drift build/latest-junit.xml; exit $$status

# One torch release on the locked rest (docs/versions.md's torch table): make test-torch TORCH_SPEC=torch==2.15.0.
# Its own virtualenv (TORCH_VENV; a CUDA build of torch is about 5 GB with its CUDA libraries and runs on the
# CPU), every other package at the lock's version, the suite but the transformers zoos, niced and in one worker
# by default (TORCH_WORKERS): the machines are shared. An existing TORCH_VENV is reused (pip moves its torch and
# the rest to what is asked; the CUDA wheels are not downloaded again). Where a pip configuration caps torch
# (this machine's /etc/xdg/pip caps it at 2.14.1), PIP_CONSTRAINT=/dev/null in the environment lifts the cap.
# The project is installed with that torch pinned: a release outside pyproject.toml's torch range stops pip with
# a conflict (widen the range to try it) instead of being swapped silently for one inside it.
# TORCH_TESTS narrows the run (docs/versions.md's parts), e.g. TORCH_TESTS="tests/exporting tests/blocks".
TORCH_VENV ?= .venv-torch
TORCH_WORKERS ?= 1
TORCH_TESTS ?=
test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	grep -iv '^torch==' requirements/lock.txt > $(TORCH_VENV)/lock-but-torch.txt
	$(TORCH_VENV)/bin/python -m pip install --quiet --constraint $(TORCH_VENV)/lock-but-torch.txt "$(TORCH_SPEC)" setuptools
	$(TORCH_VENV)/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
		>> $(TORCH_VENV)/lock-but-torch.txt  # the wheel's version (2.15.0): torch.__version__'s +cu132 is on no index
	$(TORCH_VENV)/bin/python -m pip install --quiet --constraint $(TORCH_VENV)/lock-but-torch.txt --no-build-isolation \
		-e '.[dev,serve,diffusers]'
	$(TORCH_VENV)/bin/python -m rope_export.cli build-plugin
	mkdir -p build; status=0; ROPE_EXPORT_NO_LOCK=1 nice -n 15 $(TORCH_VENV)/bin/python -m pytest -q -n $(TORCH_WORKERS) $(TORCH_TESTS) \
		--ignore=tests/hf/test_hf_zoo.py --ignore=tests/hf/test_hf_task_zoo.py --junitxml build/torch-junit.xml \
		|| status=$$?; \
		$(TORCH_VENV)/bin/python scripts/versions.py drift build/torch-junit.xml; exit $$status

# The lower bounds pyproject.toml declares (requirements/oldest.txt, the oldest versions the suite was
# shown to pass on), in their own virtualenv, without the serve extra (onnxruntime-genai needs onnxruntime
# >= 1.31; its tests skip); the suite without the zoo, whose records hold one
# transformers version's results (docs/versions.md's table has the zoo per version).
OLDEST_VENV ?= .venv-oldest
test-oldest:
	rm -rf $(OLDEST_VENV) && $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --constraint requirements/oldest.txt "$(TORCH_SPEC)" setuptools
	$(OLDEST_VENV)/bin/python -m pip install --quiet --constraint requirements/oldest.txt --no-build-isolation -e '.[dev]'
	$(OLDEST_VENV)/bin/python -m rope_export.cli build-plugin
	ROPE_EXPORT_NO_LOCK=1 $(OLDEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --ignore=tests/hf/test_hf_zoo.py \
		--ignore=tests/hf/test_hf_task_zoo.py

# Re-record every zoo type (tests/hf/hf_zoo_results.json) and re-render docs/transformers.md's zoo table, and the
# locked transformers' row of the version table.
hf-zoo: setup plugin
	rm -f build/hf_zoo.jsonl && mkdir -p build
	HF_ZOO_RECORD=build/hf_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/hf/test_hf_zoo.py || true
	$(PY) tests/hf/hf_zoo_table.py build/hf_zoo.jsonl
	$(PY) tests/hf/hf_zoo_versions.py build/hf_zoo.jsonl "$$($(PY) -c 'import transformers; print(transformers.__version__)')" whole

# Re-record every type of the task zoo (tests/hf/hf_task_zoo_results.json) and re-render docs/tasks.md's table.
hf-task-zoo: setup plugin
	rm -f build/hf_task_zoo.jsonl && mkdir -p build
	HF_TASK_ZOO_RECORD=build/hf_task_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/hf/test_hf_task_zoo.py \
		-k test_task_zoo_type || true
	$(PY) tests/hf/hf_task_zoo_table.py build/hf_task_zoo.jsonl

# The VLM zoo (tests/hf/test_vlm_zoo.py): every image-text-to-text type, recorded and rendered into
# docs/vision-language.md.
vlm-zoo: setup plugin
	rm -f build/vlm_zoo.jsonl && mkdir -p build
	VLM_ZOO_RECORD=build/vlm_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/hf/test_vlm_zoo.py -k type_as || true
	$(PY) tests/hf/vlm_zoo_table.py build/vlm_zoo.jsonl

# Re-record every class of the diffusers zoo (tests/diffusion/diffusers_zoo_results.json): the counts, then the
# exports of the classes that rotate; and re-render docs/diffusers.md's zoo table.
diffusers-zoo: setup plugin
	rm -f build/diffusers_zoo.jsonl && mkdir -p build
	DIFFUSERS_ZOO_RECORD=build/diffusers_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/diffusion/test_diffusers_zoo.py -k census || true
	$(PY) tests/diffusion/diffusers_zoo_table.py build/diffusers_zoo.jsonl
	DIFFUSERS_ZOO_RECORD=build/diffusers_zoo.jsonl $(PY) -m pytest -q -m "slow or not slow" tests/diffusion/test_diffusers_zoo.py -k exports || true
	$(PY) tests/diffusion/diffusers_zoo_table.py build/diffusers_zoo.jsonl

# The quick zoo (make test's third of it) on another transformers release, for docs/versions.md's version
# table: make hf-zoo-version TRANSFORMERS=5.0.0. No lock (pip picks what that release needs), own venv.
TRANSFORMERS ?=
TF_VENV ?= .venv-transformers
hf-zoo-version: setup plugin
	@test -n "$(TRANSFORMERS)" || { echo "give the release: make hf-zoo-version TRANSFORMERS=X.Y.Z"; exit 2; }
	rm -rf $(TF_VENV) && $(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" setuptools
	$(TF_VENV)/bin/python -m pip install --quiet --no-build-isolation -e '.[dev]' 'transformers==$(TRANSFORMERS)'
	rm -f build/hf_zoo-$(TRANSFORMERS).jsonl
	HF_ZOO_RECORD=build/hf_zoo-$(TRANSFORMERS).jsonl $(TF_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) \
		tests/hf/test_hf_zoo.py -k test_zoo_type || true
	$(PY) tests/hf/hf_zoo_versions.py build/hf_zoo-$(TRANSFORMERS).jsonl $(TRANSFORMERS) quick

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(OLDEST_VENV) $(TF_VENV) build out .pytest_cache .ruff_cache .hypothesis
