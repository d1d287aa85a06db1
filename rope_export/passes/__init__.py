"""Graph passes on ONNX models, built on onnxscript's rewriter (onnx-ir).

* ``lower(model, target)``: rope_export::RotaryEmbedding -> ``trt-plugin`` | ``onnx`` | ``ort`` |
  ``decomposed`` (registry: ``rope_export.passes.lowering.TARGETS``).
* ``fuse(model)``: decomposed RoPE in other exporters' files -> rope_export::RotaryEmbedding.

Each graph rule is a class with ``pattern``, ``check`` and ``rewrite`` in its own module
(``lower_*.py``, ``fuse_*.py``); the drivers are ``lowering.py`` and ``fusion.py``; the CLI
(``rope-export lower`` / ``rope-export fuse``) is ``cli.py``.
"""

import importlib

# Imported on first use (PEP 562): onnxscript's rewriter takes a second to import, and
# `rope-export lower --help` only needs passes/targets.py.
_EXPORTS = {
    "FusionReport": "_fusing", "SiteRecord": "_fusing", "LoweringLog": "_lowering",
    "PassError": "_model", "check_model": "_model", "load_ir": "_model", "load_model": "_model",
    "save_model": "_model", "fuse": "fusion", "TARGETS": "lowering", "lower": "lowering",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"rope_export.passes.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    try:  # a submodule, as `rope_export.passes.NAME` was before the imports became lazy
        return importlib.import_module(f"rope_export.passes.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"rope_export.passes.{name}":  # the submodule exists; something it imports is missing
            raise
        raise AttributeError(f"module 'rope_export.passes' has no attribute {name!r}") from None


__all__ = [
    "TARGETS",
    "FusionReport",
    "LoweringLog",
    "PassError",
    "SiteRecord",
    "check_model",
    "fuse",
    "load_model",
    "load_ir",
    "lower",
    "save_model",
]
