"""Finding RoPE rotations by what they compute.

* ``count_rotations`` (``witness.py``): the rotations one eager forward of a module performs,
  counted from the ATen ops it runs, independent of any hook or fusion rule;
* ``compare_with_file`` (``census.py``): that count against the rotary nodes of an ONNX file,
  raising ``DecomposedRotationError`` naming the sites left decomposed.
"""

from rope_export.detect.census import (
    CountReport,
    DecomposedRotationError,
    RotationCountError,
    compare_with_file,
    rotary_nodes,
)
from rope_export.detect.witness import RotationCensus, RotationSite, WitnessError, count_rotations

__all__ = [
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
