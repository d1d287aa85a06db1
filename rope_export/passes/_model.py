"""Model plumbing shared by the passes: accepted input kinds, opset imports, load and atomic save.

Files are read with ``onnx_files.load``: external weights stay on disk as lazy tensors, which the
rewrite rules never read (only small constants: slice bounds, cos/sin tables), and are streamed
from the input's data file to the output's when saving. So a pass over a 16 GB model holds the
graph in memory, not the weights.
"""

from __future__ import annotations

import contextlib
import os

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

import rope_export.op.onnx_op  # noqa: F401 - registers the rope_export schema (checker, shape inference)
from rope_export.files import onnx_files
from rope_export.op.contract import DOMAIN


class PassError(ValueError):
    """A graph pass that cannot do what was asked; the message names the problem and the fix."""


ModelLike = "onnx.ModelProto | ir.Model | str | os.PathLike"


def to_ir(model) -> tuple[ir.Model, str]:
    """(an ir.Model the caller may modify, the kind to hand back: "proto" or "ir").

    A path is loaded lazily (weights stay on disk) and handed back as an ir.Model: turning a
    large model into one ModelProto would pull every weight into memory.
    """
    if isinstance(model, ir.Model):
        return model, "ir"
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model), "proto"
    if isinstance(model, (str, os.PathLike)):
        return load_ir(model), "ir"
    raise TypeError(
        f"expected an onnx.ModelProto, an onnx_ir.Model or a path to a .onnx file, got {type(model).__name__}"
    )


def from_ir(model: ir.Model, kind: str):
    return model if kind == "ir" else ir.to_proto(model)


def load_ir(path: str | os.PathLike) -> ir.Model:
    """The model at ``path`` with its external weights left on disk; PassError naming the file if unusable."""
    try:
        return onnx_files.load(path)
    except onnx_files.OnnxFileError as exc:
        raise PassError(str(exc)) from None


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """The model at ``path`` as one ModelProto, weights included (small models; use ``load_ir`` for large ones)."""
    model = load_ir(path)
    if onnx_files.weight_bytes(model) >= onnx_files.EXTERNAL_DATA_THRESHOLD:
        raise PassError(f"{path} has more than 2 GB of weights, too many for one ModelProto; load it with "
                        "rope_export.passes.load_ir (weights stay on disk) or pass the path to lower/fuse")
    return ir.to_proto(onnx_files.load_to_memory(model))


def save_model(model: onnx.ModelProto | ir.Model, path: str | os.PathLike, external: str = "auto",
               progress=None) -> onnx_files.Written:
    """Write atomically (``onnx_files.write``): past protobuf's 2 GB limit the weights go to
    ``<name>.data`` beside it, streamed from wherever they are (memory or the input's data file);
    the data lands before the model that names it, and an old pair is never half replaced."""
    return onnx_files.write(model, path, external=external, progress=progress)


def onnx_opset(model: ir.Model) -> int | None:
    versions = {v for k, v in model.opset_imports.items() if k in ("", "ai.onnx")}
    if len(versions) > 1:
        raise PassError(f"the model imports two ai.onnx opsets {sorted(versions)}; keep one (the domain '')")
    return versions.pop() if versions else None


def require_onnx_opset(model: ir.Model, minimum: int, why: str) -> None:
    version = onnx_opset(model)
    if version is None:
        model.opset_imports[""] = minimum
    elif version < minimum:
        raise PassError(
            f"the model imports ai.onnx opset {version}, {why} needs >= {minimum}; convert it first with "
            f"onnx.version_converter.convert_version(model, {minimum})"
        )


def bump_onnx_opset(model: ir.Model, target: int) -> ir.Model:
    """Make the model import ai.onnx ``target`` (>= its current opset) without changing what it computes.

    When no ai.onnx op in the model (graph, subgraphs, functions) has a newer schema between the
    current opset and ``target``, only the import changes. Otherwise onnx's version converter
    rewrites the changed ops; if it cannot, the error names those ops.
    """
    current = onnx_opset(model)
    if current is not None and current >= target:
        return model
    _raise_ir_version(model, target)
    if current is None:
        model.opset_imports[""] = target
        return model
    changed = sorted(_ops_changed_between(model, current, target))
    if not changed:
        model.opset_imports[""] = target
        for function in model.functions.values():
            if "" in function.opset_imports:
                function.opset_imports[""] = target
        return model
    try:
        converted = onnx.version_converter.convert_version(ir.to_proto(model), target)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError/IndexError/...
        raise PassError(
            f"the model imports ai.onnx opset {current} and the target needs {target}; ops {changed} changed "
            f"between those opsets and onnx's version converter failed ({exc}). Re-export the model at opset "
            f"{target}, or pick a target that works at opset {current} (ort, decomposed)"
        ) from None
    converted = ir.from_proto(converted)
    _raise_ir_version(converted, target)
    return converted


def _raise_ir_version(model: ir.Model, opset: int) -> None:
    """An opset needs a minimum IR version (opset 23: IR 11); raise the file's if it is older."""
    needed = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)])
    if model.ir_version is None or model.ir_version < needed:
        model.ir_version = needed


def _ops_changed_between(model: ir.Model, old: int, new: int) -> set[str]:
    changed: set[str] = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        changed |= _node_changed(node, old, new)
    for function in model.functions.values():
        for node in ir.traversal.RecursiveGraphIterator(function):
            changed |= _node_changed(node, old, new)
    return changed


def _node_changed(node: ir.Node, old: int, new: int) -> set[str]:
    if node.domain not in ("", "ai.onnx"):
        return set()
    try:
        before = onnx.defs.get_schema(node.op_type, old, "").since_version
        after = onnx.defs.get_schema(node.op_type, new, "").since_version
    except onnx.defs.SchemaError:
        return {node.op_type}
    return set() if before == after else {node.op_type}


def drop_unused_opsets(model: ir.Model, domains=(DOMAIN,)) -> None:
    used = {node.domain for node in ir.traversal.RecursiveGraphIterator(model.graph)}
    for function in model.functions.values():
        used |= {node.domain for node in function}
    for domain in domains:
        if domain not in used:
            model.opset_imports.pop(domain, None)


def infer_shapes(model: ir.Model) -> None:
    """onnx shape inference (with data propagation) into the IR; leaves the model as is on failure."""
    with contextlib.suppress(Exception):
        common_passes.ShapeInferencePass(strict_mode=False)(model)


def remove_unused(model: ir.Model) -> None:
    common_passes.RemoveUnusedNodesPass()(model)


def check_model(model: onnx.ModelProto | ir.Model | str | os.PathLike, full_check: bool = True) -> None:
    """onnx.checker on a model in memory or, for a path, on the file (external weights stay on disk);
    raises onnx.checker.ValidationError."""
    if isinstance(model, (str, os.PathLike)):
        onnx.checker.check_model(str(model), full_check=full_check)
        return
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    onnx.checker.check_model(proto, full_check=full_check)
