"""scripts/gpu_check.sh as far as a machine without a GPU takes it: arguments, and a dry run on a
simulated bare GPU machine (polygraphy, rich, TensorRT, hypothesis, matplotlib and transformers made
unimportable) that collects the GPU tests, stops where a device is needed and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rope_export.kernels.libraries import CUDA_LIBRARY, plugin_dir, source_root

SCRIPT = source_root() / "scripts" / "gpu_check.sh"
BARE = """
import importlib.abc, sys
BLOCKED = {"polygraphy", "rich", "tensorrt", "tensorrt_lean", "hypothesis", "matplotlib", "transformers"}
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on the bare GPU machine")
sys.meta_path.insert(0, _Block())
"""


def _run(*args, env=None, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "gpu_check.sh: unknown argument '--bogus' (see --help)"),
    (["--archs", "sm90"], "gpu_check.sh: --archs 'sm90': give SM numbers such as 90 or 80,90"),
    (["--prebuilt", "/nonexistent"], "gpu_check.sh: --prebuilt /nonexistent has no librope_export_cuda.so"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    proc = _run(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message)


def test_help_lists_the_options():
    proc = _run("--help")
    assert proc.returncode == 0
    for option in ("--out", "--archs", "--prebuilt", "--quick", "--no-sanitizer", "--no-bench"):
        assert option in proc.stdout


def test_dry_run_on_a_bare_machine_collects_and_stops_before_the_device(tmp_path):
    built = plugin_dir()
    if not (built / CUDA_LIBRARY).is_file():
        pytest.skip(f"{CUDA_LIBRARY} is not built here (nvcc not found)")
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() == "True":
        pytest.skip("a GPU is present: the script runs for real (not a dry run)")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "sitecustomize.py").write_text(BARE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "bare")}
    out = tmp_path / "out"
    proc = _run("--out", str(out), "--prebuilt", str(built), env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no CUDA device visible to PyTorch: built and collected" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "no-device" and report["benchmark"] is None
    (collect,) = report["steps"]
    assert collect["step"] == "collect" and collect["exit"] == 0
    log = (out / "collect.log").read_text()
    assert "tests/kernels/test_gpu_kernels.py::test_every_variant_matches_the_reference" in log
    assert "tests/kernels/test_gpu_kernels.py::test_more_than_2_31_elements" in log
    assert "error" not in log.lower()
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: no-device") and "No GPU figure." in md
    assert not Path(out / "gpu_bench.json").exists()
