"""Export RoPE attention blocks to ONNX with one ``rope_export::RotaryEmbedding`` node per rotated
tensor, on torch's dynamo exporter with a ``custom_translation_table``.

The file has dynamic batch, sequence and (with ``decode=True``) past length, so one file serves
prefill (S > 1, past length 0) and decode (S = 1 with past keys/values). ``position_ids`` is a
graph input; caches are float32 initializers sized to the cache length (the preset's maximum
position unless told otherwise), never to the example. The RoPE configuration lands in the
model's metadata (``rope_export.*`` keys) so ``check`` can rebuild the PyTorch block from the
file alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from rope_export import (
    __version__,
    contract,
    onnx_files,
    onnx_op,  # noqa: F401  (registers the rope_export schema for onnxscript)
)
from rope_export.cli_options import EXTERNAL_DATA
from rope_export.export_command import DTYPE_NAMES, MIN_OPSET
from rope_export.fileio import check_writable
from rope_export.onnx_files import output_files  # noqa: F401 - re-exported for hf/cli, module_export, bench
from rope_export.presets import Preset, load_preset
from rope_export.torch_onnx import quiet_exporter as _quiet_exporter  # rope_export.hf imports it from here

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
    return {torch.ops.rope_export.rotary_embedding.default: _rotary_translation}


@dataclass(frozen=True)
class ExportResult:
    model: onnx.ModelProto
    path: Path | None
    preset: Preset
    dtype: str
    decode: bool

    @property
    def custom_nodes(self) -> int:
        return count_rotary_nodes(self.model)


def count_rotary_nodes(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.domain == contract.DOMAIN and n.op_type == contract.OP_TYPE)


def example_inputs(preset: Preset, dtype: torch.dtype, decode: bool, batch: int = 2, seq: int = 4,
                   past: int = 3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs for one call of the block, in INPUT_NAMES order (past only with ``decode``)."""
    a = preset.attention
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, a.hidden_size, generator=generator).to(dtype)
    positions = (torch.arange(seq) + (past if decode else 0)).expand(batch, seq).contiguous()
    if not decode:
        return hidden, positions
    kv = (batch, a.num_kv_heads, past, a.head_dim)
    return (
        hidden,
        positions,
        torch.randn(kv, generator=generator).to(dtype),
        torch.randn(kv, generator=generator).to(dtype),
    )


def _dynamic_shapes(decode: bool):
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=2**20)
    shapes = [{0: batch, 1: seq}, {0: batch, 1: seq}]
    if decode:
        past = torch.export.Dim("past", min=0, max=2**20)
        shapes += [{0: batch, 2: past}, {0: batch, 2: past}]
    return tuple(shapes)


def _check_opset(opset: int) -> None:
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


def export_program(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, opset: int = 23,
                   decode: bool = False, verbose: bool = False, progress: Callable[[str], None] | None = None):
    """torch.onnx's ONNXProgram of a block called as ``(hidden_states, position_ids[, past_key, past_value])``."""
    _check_opset(opset)
    n_in = 4 if decode else 2
    with torch.no_grad(), _quiet_exporter(verbose, progress):
        return torch.onnx.export(
            block,
            tuple(inputs[:n_in]),
            dynamo=True,
            opset_version=opset,
            input_names=list(INPUT_NAMES[:n_in]),
            output_names=list(OUTPUT_NAMES),
            dynamic_shapes=_dynamic_shapes(decode),
            custom_translation_table=custom_translation_table(),
            verbose=True if verbose else None,  # None: torch.onnx prints its phases; _quiet_exporter makes them steps
        )


def _named_graph(program, decode: bool, metadata: dict[str, str] | None) -> onnx.ModelProto:
    graph = graph_proto(program)
    rename_dynamic_dims(graph, batch_seq=(0, 0), past=2 if decode else None)
    for key, value in (metadata or {}).items():
        graph.metadata_props.add(key=key, value=value)
    graph.producer_name, graph.producer_version = "rope-export", __version__
    return graph


def export_block(
    block: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    opset: int = 23,
    decode: bool = False,
    metadata: dict[str, str] | None = None,
    verbose: bool = False,
) -> onnx.ModelProto:
    """Export a block whose forward is ``(hidden_states, position_ids[, past_key, past_value])``; in memory."""
    program = export_program(block, inputs, opset=opset, decode=decode, verbose=verbose)
    return finish_export(_named_graph(program, decode, metadata), program, check=False)


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


def preset_metadata(preset: Preset, dtype: str, seed: int, cache_len: int | None, decode: bool) -> dict[str, str]:
    return {
        METADATA_PREFIX + "version": __version__,
        METADATA_PREFIX + "preset": json.dumps(preset.to_dict(), sort_keys=True),
        METADATA_PREFIX + "dtype": dtype,
        METADATA_PREFIX + "seed": str(seed),
        METADATA_PREFIX + "cache_len": "" if cache_len is None else str(cache_len),
        METADATA_PREFIX + "decode": str(int(decode)),
        METADATA_PREFIX + "out_of_range_positions": contract.OUT_OF_RANGE,
    }


def read_metadata(model: onnx.ModelProto) -> dict:
    """The export settings written by ``preset_metadata``: preset (a Preset), dtype, seed, ..."""
    props = {p.key.removeprefix(METADATA_PREFIX): p.value for p in model.metadata_props
             if p.key.startswith(METADATA_PREFIX)}
    if props.get("source") == "transformers":
        raise ExportError(
            "the file was exported from a transformers model (`export --hf`): read its settings with "
            "rope_export.hf.read_hf_metadata (`rope-export check` reads either kind)"
        )
    if "preset" not in props:
        raise ExportError("the file has no rope_export metadata; was it written by `rope-export export`?")
    return {
        "preset": Preset.from_dict(json.loads(props["preset"]), origin="model metadata"),
        "dtype": props.get("dtype", "fp32"),
        "seed": int(props.get("seed", "0")),
        "cache_len": int(props["cache_len"]) if props.get("cache_len") else None,
        "decode": props.get("decode") == "1",
    }


def export(
    preset: str | Path | Preset = "tiny",
    output: str | os.PathLike | None = None,
    *,
    dtype: str = "fp32",
    opset: int = 23,
    decode: bool = False,
    seed: int = 0,
    cache_len: int | None = None,
    external: str = "auto",
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> ExportResult:
    """Export a preset's block (seeded random weights) and, with ``output``, write it atomically.

    ``external``: where the weights go (``onnx_files.EXTERNAL_DATA``: auto, single, per-tensor,
    never). With ``output``, ``result.model`` is the file as written (see ``finish_export``).
    """
    say = progress or (lambda message: None)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if external not in EXTERNAL_DATA:
        raise ExportError(f"unknown external data mode {external!r}; use one of {', '.join(EXTERNAL_DATA)}")
    _check_opset(opset)
    if output is not None:
        _check_writable(Path(output))
    preset = preset if isinstance(preset, Preset) else load_preset(preset)
    say(f"building the {preset.name} block ({dtype}, seed {seed})")
    block = preset.build_block(DTYPES[dtype], seed=seed, cache_len=cache_len)
    inputs = example_inputs(preset, DTYPES[dtype], decode)
    say("exporting with torch.export + the rope_export translation")
    metadata = preset_metadata(preset, dtype, seed, cache_len, decode)
    program = export_program(block, inputs, opset=opset, decode=decode, verbose=verbose, progress=say)
    model = finish_export(_named_graph(program, decode, metadata), program, output, external=external, progress=say)
    return ExportResult(model, None if output is None else Path(output), preset, dtype, decode)


def _check_writable(path: Path) -> None:
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


def decomposed_export(preset: Preset, dtype: str = "fp32", decode: bool = False, opset: int = 23,
                      cache_len: int | None = None) -> onnx.ModelProto:
    """A plain torch.onnx.export of the same block with RoPE written as plain torch ops."""
    block = preset.build_block(DTYPES[dtype], cache_len=cache_len)
    for module in block.modules():
        if hasattr(module, "mode"):
            module.mode = "decomposed"
    with torch.no_grad(), _quiet_exporter(False):
        program = torch.onnx.export(
            block, example_inputs(preset, DTYPES[dtype], decode), dynamo=True, opset_version=opset,
            input_names=list(INPUT_NAMES[: 4 if decode else 2]), output_names=list(OUTPUT_NAMES),
            dynamic_shapes=_dynamic_shapes(decode),
        )
    return program.model_proto


# -- CLI ---------------------------------------------------------------------------------------


def run_preset_export(args) -> int:
    """``rope-export export [--preset NAME] -o OUT.onnx`` (the parser: ``rope_export.export_command``)."""
    from rich.console import Console
    from rich.table import Table

    from rope_export.steps import cli_steps

    console = Console()
    with cli_steps(console, f"rope-export export: {args.output}", args.summary_json) as steps:
        result = export(args.preset, args.output, dtype=args.dtype, opset=args.opset, decode=args.decode,
                        seed=args.seed, cache_len=args.cache_len, external=args.external_data, progress=steps,
                        verbose=args.verbose)
        baseline = None
        if args.compare_decomposed:
            steps("exporting the same block with decomposed RoPE, for comparison")
            baseline = decomposed_export(result.preset, args.dtype, args.decode, args.opset, args.cache_len)
        steps.add_files(output_files(args.output))
    summary = summarize(result.model)
    table = Table(title=f"{result.path} ({result.preset.name}, {args.dtype})")
    table.add_column("what")
    table.add_column("value")
    table.add_row("nodes", str(summary["nodes"]))
    table.add_row(f"{contract.DOMAIN}::{contract.OP_TYPE} nodes", str(summary["custom_nodes"]))
    for name, dims in summary["inputs"].items():
        table.add_row(f"input {name}", str(dims))
    for name, dims in summary["outputs"].items():
        table.add_row(f"output {name}", str(dims))
    table.add_row("opsets", str(summary["opsets"]))
    if baseline is not None:
        plain = len(baseline.graph.node)
        table.add_row("nodes with decomposed RoPE", f"{plain} ({plain - summary['nodes']} fewer with the op, "
                      f"{summary['nodes'] / plain:.0%} of the plain export)")
    console.print(table)
    return 0
