"""``rope-export build-plugin``: the rotary kernels, their CPU twin and the TensorRT plugin libraries
(``rope_export.kernels.build``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rope_export.common.errors import CLIError
from rope_export.kernels import build
from rope_export.kernels.build import DEFAULT_CUDA_ARCHS, DESCRIPTION, NO_GPU_NOTE, BuildOptions, default_build_dir


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "build-plugin",
        help="build the rotary kernels, their CPU twin and the TensorRT plugin (CMake)",
        description=DESCRIPTION,
    )
    p.add_argument("--build-dir", type=Path, default=default_build_dir(),
                   help="where to build (default: build/plugins, where the other commands look)")
    p.add_argument(
        "--tensorrt-include-dir",
        default=os.environ.get("TENSORRT_INCLUDE_DIR"),
        help="folder with NvInfer.h (TensorRT 10.x/11.x); default $TENSORRT_INCLUDE_DIR",
    )
    p.add_argument(
        "--tensorrt-extra-include-dir",
        action="append",
        default=None,
        metavar="DIR",
        help="another TensorRT version's include/ (repeatable): its plugin libraries go to trt<major>.<minor>/; "
        "default $TENSORRT_EXTRA_INCLUDE_DIRS (':'-separated)",
    )
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels even if nvcc is found")
    p.add_argument(
        "--cuda-archs",
        default=DEFAULT_CUDA_ARCHS,
        help="SM architectures, ';'- or ','-separated, or all, or auto (the GPUs of this machine; none without "
        f"one); PTX of the newest is added (default all: {DEFAULT_CUDA_ARCHS})",
    )
    p.add_argument("--nvcc-threads", type=int, default=2, help="architectures nvcc compiles in parallel (default 2)")
    p.add_argument("--no-sanitize", action="store_true", help="skip the ASan/UBSan driver of the CPU twin")
    p.add_argument("--werror", action="store_true", help="treat warnings in our code as errors")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    p.add_argument("--build-type", default="Release", choices=["Release", "RelWithDebInfo", "Debug"])
    p.set_defaults(func=run)


def run(args) -> int:
    archs = build.resolve_archs(args.cuda_archs)
    if args.nvcc_threads < 0:
        raise CLIError(f"--nvcc-threads {args.nvcc_threads}: give 0 (all cores) or more")
    opts = BuildOptions(
        build_dir=args.build_dir,
        tensorrt_include_dir=args.tensorrt_include_dir,
        tensorrt_extra_include_dirs=args.tensorrt_extra_include_dir if args.tensorrt_extra_include_dir is not None
        else [d for d in os.environ.get("TENSORRT_EXTRA_INCLUDE_DIRS", "").split(":") if d],
        cuda=not args.no_cuda and archs is not None,
        cuda_archs=archs or DEFAULT_CUDA_ARCHS,
        nvcc_threads=args.nvcc_threads,
        sanitize=not args.no_sanitize,
        werror=args.werror,
        jobs=args.jobs,
        build_type=args.build_type,
    )
    summary = build.build_plugins(opts)
    sys.stdout.write(summary)
    if archs is None and not args.no_cuda:
        print(f"  note:  {NO_GPU_NOTE}")
    return 0
