"""Graph passes on ONNX models, built on onnxscript's rewriter (onnx-ir).

* ``lower(model, target)``: rope_export::RotaryEmbedding -> ``trt-plugin`` | ``onnx`` | ``ort`` |
  ``decomposed`` (registry: ``rope_export.passes.lowering.TARGETS``).
* ``fuse(model)``: decomposed RoPE in other exporters' files -> rope_export::RotaryEmbedding.

Each graph rule is a class with ``pattern``, ``check`` and ``rewrite`` in its own module
(``lower_*.py``, ``fuse_*.py``), built on what the rules of each kind share (``_lower_base.py``,
``_fuse_base.py``); the drivers are ``lowering.py`` and ``fusion.py``; the commands (``rope-export lower`` /
``rope-export fuse``) are ``rope_export.cli.passes``.
"""

from rope_export.common.lazy import lazy_getattr

# Imported on first use (PEP 562): onnxscript's rewriter takes a second to import, and
# `rope-export lower --help` only needs passes/targets.py.
_EXPORTS = {
    "FusionReport": "_fuse_base", "SiteRecord": "_fuse_base", "LoweringLog": "_lower_base",
    "PassError": "_model", "check_model": "_model", "load_ir": "_model", "load_model": "_model",
    "save_model": "_model", "fuse": "fusion", "TARGETS": "lowering", "lower": "lowering",
}


__getattr__ = lazy_getattr("rope_export.passes", _EXPORTS)

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
