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
from rope_export.hf.errors import HFExportError


def eager_rotations(module: torch.nn.Module, inputs: tuple) -> RotationCensus:
    """The rotations one eager forward of ``module(*inputs)`` performs (the model unhooked)."""
    with torch.no_grad():
        return count_rotations(module, tuple(inputs))


def count_and_compare(census: RotationCensus, onnx_model: onnx.ModelProto, *, allow_decomposed: bool,
                      notes: list[str], stacklevel: int = 3) -> CountReport:
    """The census against the file: raises DecomposedRotationError naming the layers left decomposed,
    or with ``allow_decomposed`` records that as a note and a warning (``stacklevel``: at the export's caller)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = compare_with_file(census, onnx_model, allow_decomposed=allow_decomposed)
    for warning in caught:
        notes.append(str(warning.message).splitlines()[0])
        warnings.warn(warning.message, stacklevel=stacklevel)
    return report


def refuse_no_rope(census: RotationCensus, what: str, *, allow_no_rope: bool, notes: list[str]) -> None:
    """A model that rotates nothing (GPT-2, a NoPE layer) gives rope-export nothing to do: refused before it is
    traced, so a plain export is not mistaken for a fused one; with ``allow_no_rope`` a warning and a note."""
    if census.total:
        return
    message = f"{what} performs no rotary position embedding: nothing for rope-export to fuse"
    if not allow_no_rope:
        raise HFExportError(f"{message}; export it with torch.onnx, or pass --allow-no-rope to write the file anyway")
    notes.append(f"{message} (--allow-no-rope: written anyway)")
    warnings.warn(notes[-1], stacklevel=3)
