"""The ``rope-export`` command line.

Each subcommand lives in the module that implements it, as a ``register(subparsers)`` function
that adds its parser and sets ``func``; this file only lists those modules, so adding a command
is adding a line to ``COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "rope_export.presets",
    "rope_export.export",
    "rope_export.hf.cli",  # adds the --hf options to export
    "rope_export.passes.cli",
    "rope_export.check",
    "rope_export.plugin_build",
    "rope_export.trt",
    "rope_export.bench",
    "rope_export.demo",
]


class CLIError(Exception):
    """An error the user can fix; printed as one line without a traceback, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rope-export",
        description="Export RoPE attention blocks to ONNX with one rotary op, lower and check them.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"rope-export {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
