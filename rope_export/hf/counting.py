"""The count that cannot lie: rotations transformers performs against rotary nodes in the file.

Both halves come from ``rope_export.detect`` (``count_rotations``: the eager forward's rotations
by data flow; ``compare_with_file``: the file's rotary nodes in every form, attributed to layers);
this module is the one place ``export_hf`` calls them.
"""

from __future__ import annotations

import warnings

import onnx
import torch

from rope_export.detect import CountReport, RotationCensus, compare_with_file, count_rotations


def eager_rotations(module: torch.nn.Module, inputs: tuple) -> RotationCensus:
    """The rotations one eager forward of ``module(*inputs)`` performs (the model unhooked)."""
    with torch.no_grad():
        return count_rotations(module, tuple(inputs))


def count_and_compare(census: RotationCensus, onnx_model: onnx.ModelProto, *, allow_decomposed: bool,
                      notes: list[str]) -> CountReport:
    """The census against the file: raises DecomposedRotationError naming the layers left decomposed,
    or with ``allow_decomposed`` records that as a note and a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = compare_with_file(census, onnx_model, allow_decomposed=allow_decomposed)
    for warning in caught:
        notes.append(str(warning.message).splitlines()[0])
        warnings.warn(warning.message, stacklevel=3)
    return report
