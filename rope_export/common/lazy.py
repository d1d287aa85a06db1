"""Packages whose names are imported on first use (PEP 562), so that a command's ``--help`` does not pay for
torch, onnxscript or onnxruntime."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a public name to the submodule defining it;
    any other name is tried as a submodule, as ``package.NAME`` worked before the imports became lazy."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
            vars(importlib.import_module(package))[name] = value  # found once, then a plain attribute
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":  # the submodule exists; something it imports is missing
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
