"""The TensorRT engine path: build an engine from a ``trt-plugin``-lowered ONNX file with the plugin
library loaded, save it, load it, run it (polygraphy loaders), and ``rope-export build``.

``build`` parses the file itself (so files lowered before the plugin's op type was renamed are
read as the same op), checks that every rotary node became a plugin layer of ours, and derives
the optimization profile from the file when ``--shape`` is absent or partial (rope_export.runtimes.trt_profiles).

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
from typing import TYPE_CHECKING

from rope_export.common.errors import CLIError
from rope_export.common.fileio import atomic_write_bytes
from rope_export.kernels.libraries import PLUGIN_DIR_ENV, TRT_PLUGIN_LIBRARY, TRT_VC_PLUGIN_LIBRARY, plugin_dir
from rope_export.op.nodes import (
    LEGACY_PLUGIN_NAME,
    PLUGIN_NAME,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TRT_PLUGIN_DOMAIN,
    carries_contract,
)

if TYPE_CHECKING:  # onnx and the profile code are imported where used: `rope-export build --help` answers at once
    import onnx

    from rope_export.runtimes.trt_profiles import ShapeSpec


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


def load_plugins(paths: Iterable[str | os.PathLike], trt=None) -> list[Path]:
    """Load each plugin library the way it expects, once.

    A library that registers itself (librope_export_trt_plugin.so) is opened with dlopen; one that
    exports ``getCreators`` (librope_export_trt_vc_plugin.so, other vendors' loadLibrary libraries)
    is also handed to ``trt``'s IPluginRegistry.load_library. With ``trt`` (the tensorrt module, or
    tensorrt_lean), the rotary plugin's creator must then be registered, or CLIError says why not.
    """
    loaded = []
    for p in paths:
        path = Path(p).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"plugin library {p} not found; build it with `rope-export build-plugin --tensorrt-include-dir ...` "
                f"(it lands in build/plugins, or ${PLUGIN_DIR_ENV})"
            )
        if str(path) not in _LOADED:
            lib = ctypes.CDLL(str(path))
            _LOADED[str(path)] = lib
            if trt is not None and hasattr(lib, "getCreators"):
                # None when its creators are registered already (e.g. both our libraries given): harmless.
                trt.get_plugin_registry().load_library(str(path))
        loaded.append(path)
    if trt is not None and trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None:
        names = ", ".join(p.name for p in loaded) or "no library"
        raise CLIError(
            f"the {PLUGIN_NAME} plugin (version {PLUGIN_VERSION}, namespace {PLUGIN_NAMESPACE}) is not registered "
            f"after loading {names}: pass --plugin build/plugins/{TRT_PLUGIN_LIBRARY} or {TRT_VC_PLUGIN_LIBRARY} "
            f"built against this TensorRT's headers ({trt.__version__}); the library's own message is on stderr"
        )
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


def rotary_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """Output tensor -> node label of every node that must become our plugin layer."""

    return {n.output[0]: n.name or f"{n.op_type} -> {n.output[0]}" for n in model.graph.node if carries_contract(n)}


def use_current_op_type(model: onnx.ModelProto) -> int:
    """Rename trt-plugin nodes written before the rename (op type RotaryEmbedding, which TensorRT
    >= 10.15 would import as its own layer) to the plugin's op type, in place; returns how many."""

    renamed = 0
    for node in model.graph.node:
        if node.domain == TRT_PLUGIN_DOMAIN and node.op_type == LEGACY_PLUGIN_NAME and carries_contract(node):
            node.op_type = PLUGIN_NAME
            renamed += 1
    return renamed


def check_rotary_layers(network, expected: dict[str, str], trt) -> None:
    """CLIError unless every rotary node's output comes from an IPluginV3 layer of our plugin."""
    producers = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            producers[layer.get_output(j).name] = layer
    wrong = []
    for output, label in expected.items():
        layer = producers.get(output)
        if layer is None:
            wrong.append(f"{label}: no layer produces {output}")
        elif layer.type != trt.LayerType.PLUGIN_V3:
            wrong.append(f"{label}: became a {layer.type.name} layer")
    if wrong:
        raise CLIError(
            f"{len(wrong)} of {len(expected)} rotary node(s) did not become {PLUGIN_NAME} plugin layers "
            f"({'; '.join(wrong)}); lower the file with `rope-export lower --target trt-plugin` and load the "
            "plugin library (--plugin)"
        )


def parse_network(onnx_path: Path, trt):
    """(builder, network, parser) for the file, our rotary nodes checked to be plugin layers."""
    import onnx
    from polygraphy.backend.trt import CreateNetwork, get_trt_logger

    model = onnx.load(str(onnx_path), load_external_data=False)  # weights stay where they are
    use_current_op_type(model)
    expected = rotary_nodes(model)
    # TensorRT 10 needs the flag for a strongly typed network; 11 is strongly typed always.
    strongly_typed = True if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED") else None
    builder, network = CreateNetwork(strongly_typed=strongly_typed)()
    parser = trt.OnnxParser(network, get_trt_logger())
    if not parser.parse(model.SerializeToString(), path=str(onnx_path.resolve())):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise CLIError(f"TensorRT could not parse {onnx_path}: {errors}")
    check_rotary_layers(network, expected, trt)
    return builder, network, parser


def build_engine(
    onnx_path: str | os.PathLike,
    out_path: str | os.PathLike,
    plugins: Iterable[str | os.PathLike],
    shapes: Mapping[str, ShapeSpec] | None = None,
    *,
    max_batch: int = 1,
    say=None,
) -> Path:
    """Build and save (atomically) an engine for ``onnx_path``.

    ``shapes`` (all, some or none of the inputs) are completed from the file into one optimization
    profile (rope_export.runtimes.trt_profiles); ``say`` receives one line per derived range.
    """
    trt = require_tensorrt()
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"ONNX file {onnx_path} not found")
    import onnx

    from rope_export.runtimes.trt_profiles import derive_profile

    profile_shapes, notes = derive_profile(onnx.load(str(onnx_path), load_external_data=False), shapes,
                                           max_batch=max_batch)
    for note in notes:
        (say or (lambda _: None))(f"profile: {note}")
    load_plugins(plugins, trt)
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, Profile
    from polygraphy.exception import PolygraphyException

    profile = Profile()
    for name, (lo, opt, hi) in profile_shapes.items():
        profile.add(name, min=lo, opt=opt, max=hi)
    try:
        network = parse_network(onnx_path, trt)
        data = EngineBytesFromNetwork(network, config=CreateConfig(profiles=[profile]))()
    except PolygraphyException as exc:
        raise CLIError(f"TensorRT could not build an engine from {onnx_path}: {exc}") from None
    atomic_write_bytes(out_path, bytes(data))
    return Path(out_path)


def load_engine(engine_path: str | os.PathLike, plugins: Iterable[str | os.PathLike]):
    """Deserialize an engine (the plugin libraries are loaded first)."""
    trt = require_tensorrt()
    load_plugins(plugins, trt)
    from polygraphy.backend.trt import EngineFromPath

    return EngineFromPath(str(engine_path))()


def run_engine(engine, feeds: Mapping[str, object]) -> dict[str, object]:
    """Run ``engine`` once on ``feeds`` (torch tensors or numpy arrays); outputs copied to the host."""
    require_tensorrt()
    from polygraphy.backend.trt import TrtRunner

    with TrtRunner(engine) as runner:
        return dict(runner.infer(feed_dict=dict(feeds)))
