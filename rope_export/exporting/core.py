"""The export core that the preset, transformers (``export --hf``) and module (``export_module``) exports share:
the rotary op's translation for torch.onnx, the graph of an ``ONNXProgram`` without its weights, and the file
written from it with the weights streamed and checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from rope_export.common.fileio import check_writable
from rope_export.exporting import DTYPE_NAMES, MIN_OPSET
from rope_export.files import onnx_files
from rope_export.op import (
    contract,
    onnx_op,  # noqa: F401  (registers the rope_export schema for onnxscript)
)
from rope_export.op.nodes import is_ours

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16), strict=True))
METADATA_PREFIX = "rope_export."

# Graph I/O names: the contract between export, lowering, check and the serving side.
INPUT_NAMES = ("hidden_states", "position_ids", "past_key", "past_value")
OUTPUT_NAMES = ("output", "present_key", "present_value")


class ExportError(ValueError):
    """An export request that cannot be honoured; the message names the fix."""


def _rotary_translation(x, cos_cache, sin_cache, position_ids=None, interleaved=False, num_heads=0,
                        rotary_embedding_dim=0):
    import onnxscript

    rope_opset = onnxscript.values.Opset(contract.DOMAIN, contract.OP_VERSION)
    return getattr(rope_opset, contract.OP_TYPE)(
        x,
        cos_cache,
        sin_cache,
        position_ids,
        interleaved=int(interleaved),
        num_heads=int(num_heads),
        rotary_embedding_dim=int(rotary_embedding_dim),
    )


def custom_translation_table() -> dict:
    """The rotary op's translation, and softmaxes that keep PyTorch's precision (``exporting.precision``)."""
    from rope_export.exporting.precision import translations

    return {torch.ops.rope_export.rotary_embedding.default: _rotary_translation, **translations()}


def count_rotary_nodes(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if is_ours(n))


def check_opset(opset: int) -> None:
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise ExportError(
            f"opset {opset} is outside what the file can use: {MIN_OPSET} (the lowest the dynamo exporter "
            f"emits) to {newest} (the newest this onnx knows); pick one in that range, e.g. 23 for the "
            "standard RotaryEmbedding lowering"
        )


# -- from torch.onnx's program to a file, weights streamed ----------------------------------------
#
# torch.onnx.export returns an ONNXProgram whose onnx_ir model refers to the torch tensors (or
# views of them) without copying. ``graph_proto`` gives the graph as a ModelProto to edit (names,
# metadata) with every tensor over onnx_files.INLINE_LIMIT bytes left as a placeholder, so no
# weight is copied into protobuf; ``finish_export`` puts the program's tensors back and writes
# them to disk one at a time (or, without an output path, builds the in-memory ModelProto).

PENDING_WEIGHTS = "rope-export-pending-weights"  # the placeholders' external-data location


def graph_proto(program) -> onnx.ModelProto:
    """The exported graph (an ``ONNXProgram``'s model) with placeholders instead of its large tensors."""
    swaps = {}
    for graph in program.model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is not None and tensor.nbytes > onnx_files.INLINE_LIMIT:
                swaps[value] = ir.ExternalTensor(PENDING_WEIGHTS, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                 name=value.name)
    saved = {value: value.const_value for value in swaps}
    try:
        for value, placeholder in swaps.items():
            value.const_value = placeholder
        return ir.to_proto(program.model)
    finally:
        for value, tensor in saved.items():
            value.const_value = tensor


def finish_export(graph: onnx.ModelProto, program, output: str | os.PathLike | None = None, *,
                  external: str = "auto", check: bool = True,
                  progress: Callable[[str], None] | None = None) -> onnx.ModelProto:
    """The edited ``graph_proto`` with the program's tensors back: checked, and written when ``output`` is given.

    With ``output``: weights streamed from torch to disk, onnx.checker's full check on the staged
    file, then the model and its data moved into place (``onnx_files.write``); returns the file's
    ModelProto as written (with external data, its initializers refer to ``<output>.data``).
    Without: the whole ModelProto in memory (checked when it fits protobuf's 2 GB).
    """
    say = progress or (lambda message: None)
    model = ir.from_proto(graph)
    sources = {value.name: value.const_value for g in program.model.graphs() for value in g.initializers.values()}
    for g in model.graphs():
        for value in g.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.location == PENDING_WEIGHTS:
                if value.name not in sources:
                    raise ExportError(f"initializer {value.name!r} is not in the exported program; was it renamed "
                                      "between graph_proto and finish_export?")
                value.const_value = sources[value.name]
    if output is None:
        weights = onnx_files.weight_bytes(model)
        if weights >= onnx_files.EXTERNAL_DATA_THRESHOLD:
            raise ExportError(f"the model has {weights / 1e9:.2f} GB of weights, past protobuf's 2 GB limit for one "
                              "in-memory ModelProto; give an output path (the weights then go to <output>.data)")
        proto = ir.to_proto(model)
        if check:
            say("checking the model (onnx.checker, full check)")
            onnx.checker.check_model(proto, full_check=True)
        return proto
    try:
        onnx_files.write(model, output, external=external, check=check, progress=progress)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"onnx.checker rejected the exported model, nothing was written: "
                          f"{str(exc).strip().splitlines()[0]}") from exc
    return onnx.load_model(str(output), load_external_data=False)


def rename_dynamic_dims(model: onnx.ModelProto, batch_seq: tuple[int, int], past: int | None) -> None:
    """Give the I/O's symbolic dims readable names: batch, seq, past, and past+seq on the presents.

    ``batch_seq``: (graph input index, axis of batch); seq is the next axis. ``past``: the index
    of a past key/value input (its axis 2 is the past length), or None.
    """
    graph = model.graph
    names = {}
    index, axis = batch_seq
    dims = graph.input[index].type.tensor_type.shape.dim
    for offset, name in enumerate(("batch", "seq")):
        if dims[axis + offset].dim_param:
            names[dims[axis + offset].dim_param] = name
    if past is not None and graph.input[past].type.tensor_type.shape.dim[2].dim_param:
        names[graph.input[past].type.tensor_type.shape.dim[2].dim_param] = "past"
    for value in list(graph.input) + list(graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]
            elif dim.dim_param and past is not None and value.name.startswith("present"):
                dim.dim_param = "past+seq"


def check_output_writable(path: Path) -> None:
    """Fail before the slow export, as an ExportError (the CLI prints it as one line)."""
    try:
        check_writable(path)
    except OSError as exc:
        raise ExportError(str(exc)) from None


def save_model(model: onnx.ModelProto | ir.Model, path: str | os.PathLike, external: str = "auto") -> None:
    """Write atomically; past protobuf's 2 GB limit the weights go to ``<name>.data`` (``onnx_files.write``)."""
    onnx_files.write(model, path, external=external)


def summarize(model: onnx.ModelProto) -> dict:
    """Node counts and the graph inputs with their dims (symbolic names for dynamic ones)."""
    def dims(value) -> list:
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    ops: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        ops[key] = ops.get(key, 0) + 1
    return {
        "nodes": len(model.graph.node),
        "custom_nodes": count_rotary_nodes(model),
        "ops": dict(sorted(ops.items())),
        "inputs": {v.name: dims(v) for v in model.graph.input},
        "outputs": {v.name: dims(v) for v in model.graph.output},
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
    }
