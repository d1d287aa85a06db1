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
import torch

from rope_export import __version__
from rope_export.exporting.core import (
    DTYPES,
    INPUT_NAMES,
    METADATA_PREFIX,
    OUTPUT_NAMES,
    ExportError,
    check_opset,
    check_output_writable,
    count_rotary_nodes,
    custom_translation_table,
    finish_export,
    graph_proto,
    rename_dynamic_dims,
)
from rope_export.exporting.torch_onnx import quiet_exporter
from rope_export.files import EXTERNAL_DATA
from rope_export.op import contract
from rope_export.presets import Preset, load_preset


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


def export_program(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, opset: int = 23,
                   decode: bool = False, verbose: bool = False, progress: Callable[[str], None] | None = None):
    """torch.onnx's ONNXProgram of a block called as ``(hidden_states, position_ids[, past_key, past_value])``."""
    check_opset(opset)
    n_in = 4 if decode else 2
    with torch.no_grad(), quiet_exporter(verbose, progress):
        return torch.onnx.export(
            block,
            tuple(inputs[:n_in]),
            dynamo=True,
            opset_version=opset,
            input_names=list(INPUT_NAMES[:n_in]),
            output_names=list(OUTPUT_NAMES),
            dynamic_shapes=_dynamic_shapes(decode),
            custom_translation_table=custom_translation_table(),
            verbose=True if verbose else None,  # None: torch.onnx prints its phases; quiet_exporter makes them steps
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
    check_opset(opset)
    if output is not None:
        check_output_writable(Path(output))
    preset = preset if isinstance(preset, Preset) else load_preset(preset)
    say(f"building the {preset.name} block ({dtype}, seed {seed})")
    block = preset.build_block(DTYPES[dtype], seed=seed, cache_len=cache_len)
    inputs = example_inputs(preset, DTYPES[dtype], decode)
    say("exporting with torch.export + the rope_export translation")
    metadata = preset_metadata(preset, dtype, seed, cache_len, decode)
    program = export_program(block, inputs, opset=opset, decode=decode, verbose=verbose, progress=say)
    model = finish_export(_named_graph(program, decode, metadata), program, output, external=external, progress=say)
    return ExportResult(model, None if output is None else Path(output), preset, dtype, decode)


def decomposed_export(preset: Preset, dtype: str = "fp32", decode: bool = False, opset: int = 23,
                      cache_len: int | None = None) -> onnx.ModelProto:
    """A plain torch.onnx.export of the same block with RoPE written as plain torch ops."""
    block = preset.build_block(DTYPES[dtype], cache_len=cache_len)
    for module in block.modules():
        if hasattr(module, "mode"):
            module.mode = "decomposed"
    with torch.no_grad(), quiet_exporter(False):
        program = torch.onnx.export(
            block, example_inputs(preset, DTYPES[dtype], decode), dynamo=True, opset_version=opset,
            input_names=list(INPUT_NAMES[: 4 if decode else 2]), output_names=list(OUTPUT_NAMES),
            dynamic_shapes=_dynamic_shapes(decode),
        )
    return program.model_proto
