"""Graph passes on ONNX models, built on onnxscript's rewriter (onnx-ir).

* ``lower(model, target)``: rope_export::RotaryEmbedding -> ``trt-plugin`` | ``onnx`` | ``ort`` |
  ``decomposed`` (registry: ``rope_export.passes.lowering.TARGETS``).
* ``fuse(model)``: decomposed RoPE in other exporters' files -> rope_export::RotaryEmbedding.

Each graph rule is a class with ``pattern``, ``check`` and ``rewrite`` in its own module
(``lower_*.py``, ``fuse_*.py``); the drivers are ``lowering.py`` and ``fusion.py``; the CLI
(``rope-export lower`` / ``rope-export fuse``) is ``cli.py``.
"""

from rope_export.passes._fusing import FusionReport, SiteRecord
from rope_export.passes._lowering import LoweringLog
from rope_export.passes._model import PassError, check_model, load_ir, load_model, save_model
from rope_export.passes.fusion import fuse
from rope_export.passes.lowering import TARGETS, lower

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
