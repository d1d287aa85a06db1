"""The plugin build: CUDA objects without register spills (when nvcc exists), the spill check itself,
the TensorRT glue against TensorRT headers (when $TENSORRT_INCLUDE_DIR is set), ``rope-export
build-plugin``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rope_export import cli
from rope_export.plugin_build import BuildOptions, build_plugins, ensure_built, plugins_source_dir

CHECK_SCRIPT = plugins_source_dir() / "cmake" / "nvcc_ptxas_check.cmake"
# {fp32, fp16, fp16 + fp32 cache, bf16, bf16 + fp32 cache} x {rotate-half, interleaved} x {vector, scalar}
KERNELS_PER_ARCH = 20


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc")) if p.is_file()), None
    )


def _read_report(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:] if line]


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA kernels are not compiled on this machine")
def test_cuda_kernels_compile_for_sm80_and_sm90_without_spills():
    built = ensure_built()
    report = built / "ptxas_report.txt"
    if not report.is_file():
        pytest.skip(f"the build in {built} was configured without CUDA: " + (built / "summary.txt").read_text())
    assert (built / "rotary_cuda.o").is_file()
    rows = _read_report(report)
    by_arch = {}
    for r in rows:
        by_arch.setdefault(r["arch"], []).append(r)
        assert (r["stack_bytes"], r["spill_store_bytes"], r["spill_load_bytes"]) == ("0", "0", "0"), r
        assert int(r["registers"]) <= 64, r  # __launch_bounds__(256, 4)
    assert sorted(by_arch) == ["sm_80", "sm_90"]
    assert all(len(v) == KERNELS_PER_ARCH for v in by_arch.values())
    assert all("rope::rotary_kernel" in r["kernel"] for r in rows)


PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 512 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barPf' for 'sm_80'
ptxas info    : Function properties for _Z3barPf
    {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 512 bytes cmem[0]
"""


def _check_log(tmp_path, stack, stores, loads):
    log = tmp_path / "ptxas.log"
    log.write_text(PTXAS_LOG.format(stack=stack, stores=stores, loads=loads))
    report = tmp_path / "report.txt"
    proc = subprocess.run(
        ["cmake", f"-DLOG={log}", f"-DREPORT={report}", "-P", str(CHECK_SCRIPT)], capture_output=True, text=True
    )
    return proc, report


@pytest.mark.parametrize("stack, stores, loads", [(16, 16, 16), (0, 8, 0), (0, 0, 4), (32, 0, 0)])
def test_spill_check_fails_on_spills_and_local_memory(tmp_path, stack, stores, loads):
    proc, _ = _check_log(tmp_path, stack, stores, loads)
    assert proc.returncode != 0
    assert "_Z3barPf on sm_80" in proc.stderr and "_Z3fooPf" not in proc.stderr


def test_spill_check_passes_clean_kernels_and_writes_the_report(tmp_path):
    proc, report = _check_log(tmp_path, 0, 0, 0)
    assert proc.returncode == 0, proc.stderr
    rows = _read_report(report)
    assert [(r["arch"], r["registers"]) for r in rows] == [("sm_90", "40"), ("sm_80", "255")]
    assert [r["kernel"] for r in rows] == ["foo(float*)", "bar(float*)"]


def test_spill_check_refuses_output_without_kernels(tmp_path):
    (tmp_path / "empty.log").write_text("nvcc: nothing\n")
    proc = subprocess.run(
        ["cmake", f"-DLOG={tmp_path / 'empty.log'}", f"-DREPORT={tmp_path / 'r.txt'}", "-P", str(CHECK_SCRIPT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "no kernel found" in proc.stderr


TRT_INCLUDE = os.environ.get("TENSORRT_INCLUDE_DIR")


@pytest.mark.skipif(
    not (TRT_INCLUDE and Path(TRT_INCLUDE, "NvInfer.h").is_file()),
    reason="set TENSORRT_INCLUDE_DIR to TensorRT's include/ to compile the IPluginV3 glue",
)
def test_tensorrt_glue_compiles_without_warnings_and_passes_the_smoke_test(tmp_path):
    cuda = _nvcc() is not None
    opts = BuildOptions(build_dir=tmp_path, tensorrt_include_dir=TRT_INCLUDE, cuda=cuda, sanitize=False, werror=True)
    summary = build_plugins(opts, quiet=True)
    assert "build: TensorRT glue (compile-only): TensorRT " in summary
    assert list(tmp_path.glob("**/rotary_plugin.cpp.o"))
    smoke = tmp_path / "tests" / "rope_export_glue_smoke"
    if not smoke.is_file():
        pytest.skip("glue smoke test not built (needs nvcc for the kernels, and no real libnvinfer): " + summary)
    plugin_lib = tmp_path / "tests" / "librope_export_trt_plugin_fake_nvinfer.so"
    proc = subprocess.run([str(smoke), str(plugin_lib)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    exported = subprocess.run(["nm", "-D", "--defined-only", str(plugin_lib)], capture_output=True, text=True).stdout
    assert sorted(line.split()[-1] for line in exported.splitlines()) == ["getCreators", "setLoggerFinder"]


def _cli(monkeypatch, argv):
    # Only this commands, whatever else cli.py lists.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rope_export.plugin_build", "rope_export.trt"])
    return cli.main(argv)


def test_build_plugin_command_prints_what_it_built_and_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TENSORRT_INCLUDE_DIR", raising=False)
    monkeypatch.delenv("TENSORRT_LIB_DIR", raising=False)
    rc = _cli(monkeypatch, ["build-plugin", "--build-dir", str(tmp_path), "--no-cuda", "--no-sanitize", "--werror"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "build: CPU twin: librope_export_twin.so" in out
    assert "skip:  CUDA kernels: ROPE_EXPORT_CUDA=OFF" in out
    assert "skip:  TensorRT glue: NvInfer.h not found (set TENSORRT_INCLUDE_DIR)" in out
    assert (tmp_path / "librope_export_twin.so").is_file()


def test_build_plugin_rejects_a_folder_without_tensorrt_headers(tmp_path, monkeypatch, capsys):
    rc = _cli(monkeypatch, ["build-plugin", "--build-dir", str(tmp_path), "--tensorrt-include-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1 and "holds no NvInfer.h" in err
