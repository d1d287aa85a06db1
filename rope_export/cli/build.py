"""``rope-export build``: a TensorRT engine from a trt-plugin ONNX file, with the rotary plugin loaded
(``rope_export.runtimes.trt``)."""

from __future__ import annotations

from pathlib import Path

from rope_export.common.errors import CLIError
from rope_export.kernels.libraries import PLUGIN_DIR_ENV, TRT_PLUGIN_LIBRARY
from rope_export.runtimes import trt


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="build a TensorRT engine from a trt-plugin ONNX file, with the rotary plugin loaded",
        description="Build a TensorRT engine from a file lowered with `rope-export lower --target trt-plugin`, "
        "with the rotary plugin library loaded, and write it to --output. Every rotary node must become one of "
        "the plugin's layers (a file lowered before the plugin's op type was renamed is read as the same op). "
        "The optimization profile comes from the file's inputs: give --shape for the ones whose range you know "
        "(NAME:DIMS or NAME:MIN:OPT:MAX) and --max-batch for the batch. Needs TensorRT and a CUDA GPU; without "
        "them it says which is missing in one line.",
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
        help="input shape of the optimization profile: NAME:DIMS or NAME:MIN:OPT:MAX (dims like 1x8x16x64); "
        "inputs not given, and dims named like given ones, are derived from the file",
    )
    p.add_argument("--max-batch", type=int, default=1, help="largest batch of the derived profile (default 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    trt.require_tensorrt()  # first, so a machine without TensorRT gets the one-line reason
    shapes = {}
    for spec in args.shape:
        name, ranges = trt.parse_shape(spec)
        if name in shapes:
            raise CLIError(f"--shape {name} is given twice")
        shapes[name] = ranges
    if args.max_batch < 1:
        raise CLIError(f"--max-batch {args.max_batch}: give 1 or more")
    plugins = args.plugin or [trt.default_plugin_library()]
    path = trt.build_engine(args.onnx, args.output, plugins, shapes, max_batch=args.max_batch, say=print)
    print(f"wrote {path}")
    return 0
