"""Finding RoPE rotations by what they compute.

* ``count_rotations`` (``witness.py``): the rotations one eager forward of a module performs,
  counted from the ATen ops it runs, independent of any hook or fusion rule;
* ``compare_with_file`` (``census.py``): that count against the rotary nodes of an ONNX file,
  raising ``DecomposedRotationError`` naming the sites left decomposed;
* ``forms`` (``FORMS``): the registry of rotary forms (call convention, what the function computes,
  the replacement through the rotary op, the numeric probe that proves it);
* ``functions``: the rotary functions a module's code calls, found by reading its code and verified
  against the forms, and ``rotary_functions_hooked``, the reversible hook that routes them through
  the op.
"""

from rope_export.detect.census import (
    CountReport,
    DecomposedRotationError,
    RotationCountError,
    compare_with_file,
    rotary_nodes,
)
from rope_export.detect.witness import POSITION_INPUTS, RotationCensus, RotationSite, WitnessError, count_rotations

__all__ = [
    "POSITION_INPUTS",
    "CountReport",
    "DecomposedRotationError",
    "RotationCensus",
    "RotationCountError",
    "RotationSite",
    "WitnessError",
    "compare_with_file",
    "count_rotations",
    "rotary_nodes",
]
