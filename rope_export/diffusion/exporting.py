"""``export_diffusers``: a diffusers denoising transformer to ONNX, one rotary node per rotation.

The transformer is called through its family's recipe (``recipes.py``: the inputs at a latent size and their
dynamic axes) and exported with ``export_module`` (``rope_export.blocks``; a forward torch.export cannot trace,
Lumina 2's, is replaced while tracing only by one computing the same values with tensor ops: ``trace_patches.py``),
which counts the rotations of one eager forward, routes the rotary functions it verifies through the op, fuses
every rotation left in the traced graph (diffusers' ``apply_rotary_emb`` in its interleaved and rotate-half
spellings, Wan's and LTX-Video's own, Lumina 2's complex product: all found by what they compute), and refuses a
file with fewer rotary nodes than rotations. Then the file, lowered to ``onnx``, is run on onnxruntime against the
transformer (diffusers' own forward) at a second latent size that no axis of was traced (``recipes.OTHER``), and
written with the metadata ``rope-export check`` rebuilds the transformer from
(``rope_export.check.diffusers_reference``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx_ir as ir
import torch

from rope_export.blocks.check import check_on_onnxruntime
from rope_export.blocks.export import ModuleExportResult, export_module
from rope_export.common.fileio import check_writable
from rope_export.diffusion.recipes import OTHER, TRACED, Denoiser, Inputs, LatentSize, Recipe, inputs_at, recipe_for
from rope_export.diffusion.trace_patches import traceable
from rope_export.exporting.core import DTYPES, METADATA_PREFIX
from rope_export.files import onnx_files

OUTPUT_NAME = "sample"


@dataclass
class DiffusersExportResult:
    result: ModuleExportResult  # rotations, rotary nodes, the fused model
    recipe: Recipe
    class_name: str
    path: Path | None
    dynamic: list[str]  # the dynamic axes' names ("batch", "height", ...); empty: static
    static: list[str] = field(default_factory=list)  # axes of the recipe diffusers' code specialises (kept static)
    verified: list[LatentSize] = field(default_factory=list)  # latent sizes the file equalled diffusers at
    notes: list[str] = field(default_factory=list)

    @property
    def rotary_nodes(self) -> int:
        return self.result.rotary_nodes

    @property
    def rotations(self) -> int:
        return len(self.result.census.plain)

    def as_text(self) -> str:
        lines = [self.result.as_text(), f"family: {self.recipe.name} ({self.class_name})",
                 "dynamic axes: " + (", ".join(self.dynamic) or "none (static: see the notes)")]
        lines += [f"equals diffusers on onnxruntime (onnx lowering) at {s.describe()}" for s in self.verified]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# an axis torch.export finds diffusers' code to specialise -> the latent size's fields that then stay as traced
SIZE_FIELDS = {"batch": ("batch",), "frames": ("frames",), "height": ("height",), "width": ("width",),
               "text_seq": ("text",), "image_seq": ("frames", "height", "width")}


def dynamic_shapes(inputs: Inputs, recipe: Recipe, static: frozenset[str] = frozenset()) -> tuple[tuple[dict, ...]]:
    """torch.export's specification of the inputs' dynamic axes: one Dim per axis name, shared by every input
    that has it; a latent axis the patch size divides is that multiple of its Dim; the axes named in ``static``
    keep the example's size."""
    multiples = dict(zip(("frames", "height", "width"), recipe.multiple, strict=True))
    made: dict[str, object] = {}

    def dim(name: str, latent: bool):
        multiple = multiples.get(name, 1) if latent else 1
        key = f"{name}_{multiple}" if multiple > 1 else name
        if key not in made:
            made[key] = torch.export.Dim(name) if multiple == 1 else multiple * torch.export.Dim(key)
        return made[key]

    specs = tuple({axis: dim(name, inputs.tensors[n].dim() >= 4) for axis, name in inputs.axes.get(n, {}).items()
                   if name not in static} or None for n in inputs.tensors)
    return (specs,)  # Denoiser.forward(*inputs): one entry, the tuple of the inputs' specs


def _cast(inputs: Inputs, recipe: Recipe, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The inputs in the file's precision (positions and rotary tables stay float32, as pipelines pass them)."""
    return tuple(t.to(dtype) if t.is_floating_point() and n not in recipe.float32_inputs else t
                 for n, t in inputs.tensors.items())


def export_diffusers(
    model: torch.nn.Module,
    output: str | os.PathLike | None = None,
    *,
    family: str | None = None,
    traced: LatentSize = TRACED,
    other: LatentSize = OTHER,
    seed: int = 0,
    source: dict | None = None,
    opset: int = 23,
    allow_decomposed: bool = False,
    external: str = "auto",
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> DiffusersExportResult:
    """Export a diffusers transformer (``model``, in the precision the file gets) with dynamic latent sizes.

    ``source``: what ``check`` rebuilds it from (``{"folder": ..., "component": ..., "weights": path or None,
    "seed": N}``), written to the metadata. Raises DecomposedRotationError (unless ``allow_decomposed``) and
    FileMismatchError (the file differs from diffusers at either latent size); nothing is written then."""
    say = progress or (lambda message: None)
    if output is not None:
        check_writable(output)
    model = model.eval()
    recipe = recipe_for(model, family)
    dtype = next(model.parameters()).dtype
    inputs = inputs_at(model, recipe, traced, seed)
    names = list(inputs.tensors)
    wrapper = Denoiser(model, recipe, names, inputs.constants)
    args = _cast(inputs, recipe, dtype)
    notes: list[str] = []
    say(f"{type(model).__name__}: family {recipe.name}, traced at {traced.describe()}")
    static: frozenset[str] = frozenset()
    with traceable(model) as patch_notes:  # diffusers' own forward again for the comparison below
        notes += patch_notes
        while True:  # an axis diffusers' own code specialises is made static, said in a note, and the export retried
            try:
                result = export_module(wrapper, args, dynamic_shapes=dynamic_shapes(inputs, recipe, static),
                                       input_names=names, output_names=[OUTPUT_NAME], opset=opset,
                                       allow_decomposed=allow_decomposed, progress=say, verbose=verbose)
                break
            except Exception as exc:  # noqa: BLE001 - only torch.export's "Constraints violated (AXIS)" is retried
                found = _specialised_axes(exc) - static
                if not found:
                    raise
                static |= found
                say(f"torch.export finds diffusers' code specialises {', '.join(sorted(found))}: exporting it static")
    static |= _static_in_file(result.ir_model, inputs)  # torch.onnx may specialise an axis without a word
    if static:
        other = replace(other, **{f: getattr(traced, f) for axis in static for f in SIZE_FIELDS[axis]})
        notes.append(f"{', '.join(sorted(static))} static (at {traced.describe()}): torch.export finds that "
                     "diffusers' code specialises it (Constraints violated); the other latent size varies only the "
                     "dynamic axes")
    dynamic = sorted({n for axes in inputs.axes.values() for n in axes.values()} - static)
    ir_model = result.ir_model
    ir_model.metadata_props.update(_metadata(model, recipe, traced, other, dtype, source, result))
    say(f"running the file (lowered to onnx) on onnxruntime against diffusers at {other.describe()}")
    other_args = _cast(inputs_at(model, recipe, other, seed + 1), recipe, dtype)
    other_notes = check_on_onnxruntime(wrapper, other_args, {}, ir_model)  # raises FileMismatchError on a mismatch
    notes += [n for n in other_notes if n not in result.notes]
    # a note from that run says what was not compared (bfloat16, weights past 2 GB, an output of another count)
    verified = [] if other_notes else [traced, other]
    if output is not None:
        say(f"writing {output}")
        onnx_files.write(ir_model, output, external=external, check=True, progress=say)
    return DiffusersExportResult(result, recipe, type(model).__name__, None if output is None else Path(output),
                                 dynamic, sorted(static), verified, notes)


def _static_in_file(model: ir.Model, inputs: Inputs) -> frozenset[str]:
    """The axes the recipe names that the file's inputs hold static (torch.onnx's capture refines dynamic shapes
    from torch.export's suggested fixes: an axis diffusers' code specialises becomes static silently)."""
    found = set()
    for value in model.graph.inputs:
        for axis, name in inputs.axes.get(value.name, {}).items():
            if value.shape is not None and axis < value.shape.rank() and isinstance(value.shape[axis], int):
                found.add(name)
    return frozenset(found & set(SIZE_FIELDS))


def _specialised_axes(exc: BaseException) -> frozenset[str]:
    """The latent axes a torch.export failure names as specialised ("Constraints violated (batch)!"), else none."""
    found, seen = set(), set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        match = re.search(r"Constraints violated \(([^)]*)\)", str(exc))
        if match:
            found |= {re.sub(r"_\d+$", "", name.strip()) for name in match.group(1).split(",")}
        exc = exc.__cause__ or exc.__context__
    return frozenset(found & set(SIZE_FIELDS))


def _metadata(model, recipe: Recipe, traced: LatentSize, other: LatentSize, dtype, source: dict | None,
              result) -> dict[str, str]:
    import diffusers

    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    meta = {"source": "diffusers", "diffusers_class": type(model).__name__, "diffusers_family": recipe.name,
            "diffusers_version": diffusers.__version__, "diffusers_config": json.dumps(config, default=list),
            "dtype": dtype_name, "traced_latent": json.dumps(vars(traced)), "other_latent": json.dumps(vars(other)),
            "rotations_eager": str(len(result.census.plain)), "rotary_nodes": str(result.rotary_nodes)}
    if source:
        meta["diffusers_source"] = json.dumps(source)
    return {METADATA_PREFIX + k: v for k, v in meta.items()}


def ir_metadata(model: ir.Model) -> dict[str, str]:
    """The file's rope_export metadata, without the prefix."""
    return {k.removeprefix(METADATA_PREFIX): v for k, v in model.metadata_props.items()
            if k.startswith(METADATA_PREFIX)}
