"""The TensorRT engine path: build an engine from a ``trt-plugin``-lowered ONNX file with the plugin
library loaded, save it, load it, run it (polygraphy loaders), and ``rope-export build``.

TensorRT and polygraphy's TensorRT backend are imported only when used, so the package imports and
its other commands work on machines without them. Without TensorRT, or without a usable CUDA GPU,
``rope-export build`` says so in one line and exits non-zero.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from rope_export.cli import CLIError
from rope_export.fileio import atomic_write_bytes
from rope_export.plugin import PLUGIN_DIR_ENV, TRT_PLUGIN_LIBRARY, plugin_dir

ShapeSpec = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # min, opt, max


class TensorRTUnavailable(CLIError):
    """TensorRT or a CUDA GPU is missing; the message says which."""


def _cuda_device_problem() -> str | None:
    """Why no CUDA device can be used, or None. Asks the driver directly (torch may be a CPU build)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 not found)"
    if cuda.cuInit(0) != 0:
        return "the NVIDIA driver failed to initialise (cuInit)"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return "no CUDA GPU visible"
    return None


def tensorrt_unavailable_reason() -> str | None:
    """One line saying why engines cannot be built or run here, or None when they can."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return (
            "TensorRT is not installed (pip install 'rope-export[trt]' on a machine with an NVIDIA GPU); "
            "engines cannot be built or run here"
        )
    problem = _cuda_device_problem()
    if problem:
        return f"TensorRT needs a CUDA GPU to build or run engines: {problem}"
    return None


def require_tensorrt():
    """The tensorrt module, or TensorRTUnavailable."""
    reason = tensorrt_unavailable_reason()
    if reason:
        raise TensorRTUnavailable(reason)
    import tensorrt

    return tensorrt


def default_plugin_library() -> Path:
    return plugin_dir() / TRT_PLUGIN_LIBRARY


_LOADED: dict[str, ctypes.CDLL] = {}


def load_plugins(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """dlopen each plugin library once; it registers its creators itself (static registration)."""
    loaded = []
    for p in paths:
        path = Path(p).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"plugin library {p} not found; build it with `rope-export build-plugin --tensorrt-include-dir ... "
                f"--tensorrt-lib-dir ...` (it lands in build/plugins, or ${PLUGIN_DIR_ENV})"
            )
        if str(path) not in _LOADED:
            _LOADED[str(path)] = ctypes.CDLL(str(path))
        loaded.append(path)
    return loaded


_DIMS = re.compile(r"^\d+(x\d+)*$")


def parse_shape(spec: str) -> tuple[str, ShapeSpec]:
    """``NAME:1x16x8x64`` (fixed) or ``NAME:MIN:OPT:MAX`` (a range), dims joined by ``x``.

    The dims are taken from the right, so input names that contain ``:`` (``input:0``) work.
    """
    fields = spec.split(":")
    n = 3 if len(fields) >= 4 and all(_DIMS.match(f) for f in fields[-3:]) else 1
    name, parts = ":".join(fields[:-n]), fields[-n:]
    if not name or not all(_DIMS.match(f) for f in parts):
        raise CLIError(f"--shape {spec!r}: write NAME:DIMS or NAME:MIN:OPT:MAX, dims joined by x (e.g. x:1x8x16x64)")
    dims = [tuple(int(d) for d in part.split("x")) for part in parts] * (3 if n == 1 else 1)
    if len({len(d) for d in dims}) != 1:
        raise CLIError(f"--shape {spec!r}: MIN, OPT and MAX must have the same rank")
    return name, (dims[0], dims[1], dims[2])


def _network_loader(onnx_path: Path, trt):
    from polygraphy.backend.trt import NetworkFromOnnxPath

    # TensorRT 10 needs the flag for a strongly typed network; 11 is strongly typed always.
    strongly_typed = True if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED") else None
    return NetworkFromOnnxPath(str(onnx_path), strongly_typed=strongly_typed)


def build_engine(
    onnx_path: str | os.PathLike,
    out_path: str | os.PathLike,
    plugins: Iterable[str | os.PathLike],
    shapes: Mapping[str, ShapeSpec] | None = None,
) -> Path:
    """Build and save (atomically) an engine for ``onnx_path``; ``shapes`` set the optimization profile."""
    trt = require_tensorrt()
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"ONNX file {onnx_path} not found")
    load_plugins(plugins)
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, Profile
    from polygraphy.exception import PolygraphyException

    profiles = None
    if shapes:
        profile = Profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.add(name, min=lo, opt=opt, max=hi)
        profiles = [profile]
    try:
        data = EngineBytesFromNetwork(_network_loader(onnx_path, trt), config=CreateConfig(profiles=profiles))()
    except PolygraphyException as exc:
        raise CLIError(f"TensorRT could not build an engine from {onnx_path}: {exc}") from None
    atomic_write_bytes(out_path, bytes(data))
    return Path(out_path)


def load_engine(engine_path: str | os.PathLike, plugins: Iterable[str | os.PathLike]):
    """Deserialize an engine (the plugin libraries are loaded first)."""
    require_tensorrt()
    load_plugins(plugins)
    from polygraphy.backend.trt import EngineFromPath

    return EngineFromPath(str(engine_path))()


def run_engine(engine, feeds: Mapping[str, object]) -> dict[str, object]:
    """Run ``engine`` once on ``feeds`` (torch tensors or numpy arrays); outputs copied to the host."""
    require_tensorrt()
    from polygraphy.backend.trt import TrtRunner

    with TrtRunner(engine) as runner:
        return dict(runner.infer(feed_dict=dict(feeds)))


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="build a TensorRT engine from a trt-plugin ONNX file, with the rotary plugin loaded",
        description=__doc__,
    )
    p.add_argument("onnx", type=Path, help="ONNX file lowered with --target trt-plugin")
    p.add_argument("-o", "--output", type=Path, required=True, help="engine file to write")
    p.add_argument(
        "--plugin",
        action="append",
        help=f"plugin library to load (repeatable); default: {TRT_PLUGIN_LIBRARY} in build/plugins "
        f"or ${PLUGIN_DIR_ENV}",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        help="input shape of the optimization profile: NAME:DIMS or NAME:MIN:OPT:MAX (dims like 1x8x16x64)",
    )
    p.set_defaults(func=_main)


def _main(args) -> int:
    require_tensorrt()  # first, so a machine without TensorRT gets the one-line reason
    shapes = dict(parse_shape(s) for s in args.shape)
    plugins = args.plugin or [default_plugin_library()]
    path = build_engine(args.onnx, args.output, plugins, shapes)
    print(f"wrote {path}")
    return 0
