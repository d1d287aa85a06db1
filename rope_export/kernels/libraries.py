"""Where the libraries built from ``plugins/`` are: their names, the build folder and ``$ROPE_EXPORT_PLUGIN_DIR``.

Read by the CPU twin's binding (``cpu_twin``), the CUDA library's (``cuda``), ``build-plugin`` and the TensorRT
paths; imports neither torch nor TensorRT.
"""

from __future__ import annotations

import os
from pathlib import Path

PLUGIN_DIR_ENV = "ROPE_EXPORT_PLUGIN_DIR"
TWIN_LIBRARY = "librope_export_twin.so"
TRT_PLUGIN_LIBRARY = "librope_export_trt_plugin.so"  # registers itself when opened (CDLL, --staticPlugins)
TRT_VC_PLUGIN_LIBRARY = "librope_export_trt_vc_plugin.so"  # for IPluginRegistry::loadLibrary hosts
CUDA_LIBRARY = "librope_export_cuda.so"  # the kernels behind PyTorch's CUDA op (rope_export/kernels/cuda.py)
# Every GPU TensorRT 10/11 runs on (Turing .. Blackwell); the build adds PTX of the newest.
CUDA_ARCHS = (75, 80, 86, 89, 90, 100, 120)


class PluginNotBuiltError(FileNotFoundError):
    """The plugin libraries are not built (or not where we look)."""


def source_root() -> Path:
    """The checkout: rope_export/kernels/libraries.py -> the folder holding plugins/ and build/."""
    return Path(__file__).resolve().parents[2]


def default_build_dir() -> Path:
    return source_root() / "build" / "plugins"


def plugin_dir() -> Path:
    env = os.environ.get(PLUGIN_DIR_ENV)
    return Path(env) if env else default_build_dir()


def library_path(name: str = TWIN_LIBRARY) -> Path:
    """Where ``name`` is, or PluginNotBuiltError saying how to build it."""
    path = plugin_dir() / name
    if not path.is_file():
        where = f"${PLUGIN_DIR_ENV}={os.environ[PLUGIN_DIR_ENV]}" if os.environ.get(PLUGIN_DIR_ENV) else "build/plugins"
        raise PluginNotBuiltError(
            f"{name} not found in {path.parent} ({where}); build it with `make plugin` or "
            f"`rope-export build-plugin`, or set {PLUGIN_DIR_ENV} to the folder that holds it"
        )
    return path
