"""``rope-export build-plugin``: configure and build ``plugins/`` with CMake into ``build/plugins``.

``--cuda-archs auto`` (what ``rope-export demo`` uses on a fresh build folder) compiles the CUDA
kernels only for the GPUs this machine has, so a machine without one spends no minutes on them;
the default, every architecture, is what CI builds (it fails on register spills in any of them).

What gets built depends on the machine (see plugins/CMakeLists.txt): the CPU twin always; with
nvcc the CUDA kernels (every architecture in ``--cuda-archs``, failing on register spills) and the
CUDA library behind PyTorch's CUDA op; with TensorRT headers (``--tensorrt-include-dir`` or
``$TENSORRT_INCLUDE_DIR``) the two plugin libraries, which need no libnvinfer to link. The
summary says what was built and what was skipped, and why.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rope_export.common.errors import CLIError
from rope_export.kernels.libraries import CUDA_ARCHS, PLUGIN_DIR_ENV, default_build_dir, plugin_dir, source_root

DEFAULT_CUDA_ARCHS = ";".join(str(a) for a in CUDA_ARCHS)
DESCRIPTION = (
    "Build the native code in plugins/ with CMake, into build/plugins (or --build-dir). Always: the CPU twin of "
    "the kernels (what `check` runs as cpu-twin). With nvcc: the CUDA kernels for every architecture in "
    "--cuda-archs (a register spill fails the build) and the CUDA library PyTorch's CUDA op uses. With TensorRT's "
    "headers (--tensorrt-include-dir or $TENSORRT_INCLUDE_DIR): the two plugin libraries, "
    "librope_export_trt_plugin.so (for hosts that dlopen it: polygraphy --plugins, Triton's plugins=, trtexec "
    "--staticPlugins) and librope_export_trt_vc_plugin.so (for IPluginRegistry::loadLibrary: trtexec "
    "--dynamicPlugins, the lean runtime). It ends with what was built and what was skipped, and why. "
    "A rebuild compiles only what changed."
)
NO_GPU_NOTE = "no GPU here: CUDA kernels not compiled (--cuda-archs all compiles every architecture)"


def gpu_archs() -> list[int]:
    """The SM numbers of the GPUs ``nvidia-smi`` sees; none without a GPU or its driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    archs = set()
    for cap in out.split():
        major, _, minor = cap.partition(".")
        if major.isdigit() and minor.isdigit():
            archs.add(int(major) * 10 + int(minor))
    return sorted(archs)


def resolve_archs(spec: str) -> str | None:
    """``--cuda-archs`` as CMake takes it: "all" -> every architecture, "auto" -> this machine's GPUs (None:
    there is none), else the given SM numbers, ',' or ';'-separated."""
    spec = spec.strip().lower()
    if spec == "all":
        return DEFAULT_CUDA_ARCHS
    if spec == "auto":
        found = gpu_archs()
        return ";".join(str(a) for a in found) if found else None
    archs = spec.replace(",", ";")
    if not archs or not all(a.strip().isdigit() for a in archs.split(";")):
        raise CLIError(f"--cuda-archs {spec!r}: give SM numbers such as 80;90, or all, or auto")
    return archs


@dataclass
class BuildOptions:
    build_dir: Path = field(default_factory=default_build_dir)
    tensorrt_include_dir: str | None = None
    tensorrt_extra_include_dirs: list[str] = field(default_factory=list)  # more versions, into trt<M>.<m>/
    cuda: bool = True
    cuda_archs: str = DEFAULT_CUDA_ARCHS
    nvcc_threads: int = 2
    sanitize: bool = True
    werror: bool = False
    jobs: int = 2
    build_type: str = "Release"


def plugins_source_dir() -> Path:
    return source_root() / "plugins"


def configure_command(opts: BuildOptions) -> list[str]:
    cmd = [
        "cmake", "-S", str(plugins_source_dir()), "-B", str(opts.build_dir),
        f"-DCMAKE_BUILD_TYPE={opts.build_type}",
        f"-DROPE_EXPORT_CUDA={'ON' if opts.cuda else 'OFF'}",
        f"-DROPE_EXPORT_CUDA_ARCHS={opts.cuda_archs}",
        f"-DROPE_EXPORT_NVCC_THREADS={opts.nvcc_threads}",
        f"-DROPE_EXPORT_SANITIZE={'ON' if opts.sanitize else 'OFF'}",
        f"-DROPE_EXPORT_WERROR={'ON' if opts.werror else 'OFF'}",
    ]  # fmt: skip
    # Always pass both, so a value dropped from the command line is dropped from the cache too.
    cmd.append(f"-DTENSORRT_INCLUDE_DIR={opts.tensorrt_include_dir or ''}")
    cmd.append(f"-DTENSORRT_EXTRA_INCLUDE_DIRS={';'.join(opts.tensorrt_extra_include_dirs)}")
    if shutil.which("ninja"):  # faster no-op rebuilds; CMake's default generator otherwise
        cmd[1:1] = ["-G", "Ninja"] if not (opts.build_dir / "CMakeCache.txt").is_file() else []
    return cmd


def _run(cmd: list[str], quiet: bool) -> None:
    if not quiet:
        print("+ " + " ".join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        output = ""
    else:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, output = proc.returncode, proc.stdout
    if rc:
        tail = "\n".join(output.strip().splitlines()[-40:])
        raise CLIError(f"`{' '.join(cmd[:2])} ...` failed (exit {rc})" + (f":\n{tail}" if tail else ""))


def build_plugins(opts: BuildOptions | None = None, quiet: bool = False) -> str:
    """Configure and build; returns the summary (what was built, what was skipped)."""
    opts = opts or BuildOptions()
    if shutil.which("cmake") is None:
        raise CLIError("cmake not found on PATH; install CMake >= 3.18 (e.g. `apt-get install cmake`)")
    for folder in filter(None, [opts.tensorrt_include_dir, *opts.tensorrt_extra_include_dirs]):
        if not (Path(folder) / "NvInfer.h").is_file():
            raise CLIError(f"--tensorrt-include-dir {folder} holds no NvInfer.h; point it at TensorRT's include/")
    opts.build_dir.mkdir(parents=True, exist_ok=True)
    _run(configure_command(opts), quiet)
    _run(["cmake", "--build", str(opts.build_dir), "-j", str(opts.jobs)], quiet)
    return (opts.build_dir / "summary.txt").read_text()


def ensure_built(quiet: bool = True) -> Path:
    """The folder with the built libraries, building build/plugins incrementally first.

    With $ROPE_EXPORT_PLUGIN_DIR set, that folder is used as it is. An existing build folder keeps
    the options it was configured with (``make plugin`` or ``rope-export build-plugin``), so kernels built
    once are reused; a new one compiles the CUDA kernels only for this machine's GPUs (none without one).
    """
    if os.environ.get(PLUGIN_DIR_ENV):
        return plugin_dir()
    archs = resolve_archs("auto")
    opts = BuildOptions(cuda=archs is not None, cuda_archs=archs or DEFAULT_CUDA_ARCHS)
    opts.build_dir.mkdir(parents=True, exist_ok=True)
    with open(opts.build_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build one at a time
        if (opts.build_dir / "CMakeCache.txt").is_file():
            _run(["cmake", "--build", str(opts.build_dir), "-j", str(opts.jobs)], quiet)
        else:
            build_plugins(opts, quiet)
    return opts.build_dir
