"""The plugin build: CUDA kernels for every architecture without register spills (when nvcc exists),
the spill check itself, the libraries' links and exports (TensorRT plugins when built against
$TENSORRT_INCLUDE_DIR), ``rope-export build-plugin``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rope_export import cli
from rope_export.kernels.build import ensure_built, plugins_source_dir
from rope_export.kernels.libraries import CUDA_ARCHS, CUDA_LIBRARY, TRT_PLUGIN_LIBRARY, TRT_VC_PLUGIN_LIBRARY

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
def test_cuda_kernels_compile_for_every_architecture_without_spills():
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
    # Turing to Blackwell: every GPU TensorRT 10/11 runs on (ptxas compiles each from its own PTX).
    assert sorted(by_arch, key=lambda a: int(a[3:])) == [f"sm_{a}" for a in CUDA_ARCHS]
    assert all(len(v) == KERNELS_PER_ARCH for v in by_arch.values())
    assert all("rope::rotary_kernel" in r["kernel"] for r in rows)
    # The refusal message names the architectures the kernels carry (newest also as PTX).
    header = (built / "rope_cuda_archs.h").read_text()
    assert f'ROPE_EXPORT_CUDA_ARCH_LIST "{",".join(map(str, CUDA_ARCHS))}"' in header


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


ALLOWED_NEEDED = {"libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2", "libm.so.6",
                  "libdl.so.2", "libpthread.so.0", "librt.so.1"}


def _needed(lib: Path) -> set[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line}


def _exports(lib: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines())


def _plugin_dirs(built: Path) -> list[Path]:
    return [d for d in [built, *sorted(built.glob("trt*"))] if (d / "tensorrt_version.txt").is_file()]


def test_plugin_libraries_need_neither_libnvinfer_nor_a_shared_cuda_runtime():
    built = ensure_built()
    dirs = _plugin_dirs(built)
    if not dirs:
        pytest.skip("no TensorRT plugin libraries in this build: set TENSORRT_INCLUDE_DIR to TensorRT's include/ "
                    "(NVIDIA/TensorRT's include/ at tag v11.1, extracted outside the repository: docs/tensorrt.md, "
                    "'TensorRT headers') and run `make plugin`")
    for d in dirs:
        static, vc = d / TRT_PLUGIN_LIBRARY, d / TRT_VC_PLUGIN_LIBRARY
        for lib in (static, vc):
            assert _needed(lib) <= ALLOWED_NEEDED, (lib, _needed(lib))  # no libnvinfer*, no libcudart
        assert _exports(static) == []  # registers itself when opened, exports nothing
        assert _exports(vc) == ["getCreators", "setLoggerFinder"]  # TensorRT's plugin-library entry points
        flags = subprocess.run(["readelf", "-d", str(static)], capture_output=True, text=True).stdout
        assert "NODELETE" in flags  # registries keep its creator: it must never be unmapped


def test_cuda_library_exports_its_c_abi_only():
    built = ensure_built()
    lib = built / CUDA_LIBRARY
    if not lib.is_file():
        pytest.skip(f"{CUDA_LIBRARY} is not built here (nvcc not found): " + (built / "summary.txt").read_text())
    assert _needed(lib) <= ALLOWED_NEEDED
    assert _exports(lib) == ["rope_cuda_api_version", "rope_cuda_built_archs", "rope_cuda_device_check",
                             "rope_cuda_device_info", "rope_cuda_run", "rope_cuda_run_pair"]


def test_glue_driven_through_get_creators_passes_its_checks():
    built = ensure_built()
    smoke = built / "tests" / "rope_export_glue_smoke"
    if not smoke.is_file():
        pytest.skip("the TensorRT plugin libraries are not built (set TENSORRT_INCLUDE_DIR): "
                    + (built / "summary.txt").read_text())
    proc = subprocess.run([str(smoke), str(built / TRT_VC_PLUGIN_LIBRARY)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "glue smoke test: ok", proc.stderr


def _cli(monkeypatch, argv):
    # Only this commands, whatever else cli.py lists.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rope_export.cli.build_plugin", "rope_export.cli.build"])
    return cli.main(argv)


def test_build_plugin_command_prints_what_it_built_and_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TENSORRT_INCLUDE_DIR", raising=False)
    monkeypatch.delenv("TENSORRT_EXTRA_INCLUDE_DIRS", raising=False)
    rc = _cli(monkeypatch, ["build-plugin", "--build-dir", str(tmp_path), "--no-cuda", "--no-sanitize", "--werror"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "build: CPU twin: librope_export_twin.so" in out
    assert "skip:  CUDA kernels: ROPE_EXPORT_CUDA=OFF" in out
    assert "skip:  TensorRT plugins: NvInfer.h not found (set TENSORRT_INCLUDE_DIR)" in out
    assert (tmp_path / "librope_export_twin.so").is_file()


def test_build_plugin_rejects_a_folder_without_tensorrt_headers(tmp_path, monkeypatch, capsys):
    rc = _cli(monkeypatch, ["build-plugin", "--build-dir", str(tmp_path), "--tensorrt-include-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1 and "holds no NvInfer.h" in err
