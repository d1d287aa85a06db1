"""``rope-export package STACK ...``: one sub-command per serving stack.

Each stack's module adds its own sub-command (``register_triton(stacks)``), so adding a stack is
adding a line to ``STACKS``.
"""

from __future__ import annotations

import importlib

STACKS = [
    ("rope_export.serve.triton", "register_triton"),
]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "package", help="package an exported file for a serving stack (a Triton model repository, ...)",
        description="Write what a serving stack loads, from an ONNX file of rope-export.")
    stacks = parser.add_subparsers(dest="stack", metavar="STACK", required=True)
    for module, function in STACKS:
        getattr(importlib.import_module(module), function)(stacks)
