"""``export_hf``: a transformers causal LM (or one attention layer) to ONNX, every rotation one rotary node.

The steps, each its own function below:

1. read the cache geometry and make the tracing inputs (one tiny eager forward);
2. count the rotations transformers performs in one eager forward of the same wrapper
   (``rope_export.detect.count_rotations``: by data flow, independent of the hook);
3. find the rotary function(s) the model's code calls and verify them (``rope_export.detect``);
4. export with those functions routed through the rotary op; if none verified, export plain and
   fuse the traced graph (``rope_export.passes.fuse``), automatically;
5. compare the count with the file's rotary nodes: a rotation left decomposed is an error naming
   its layers (``allow_decomposed``: a warning and a note);
6. metadata, onnx.checker, an atomic write.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from rope_export.detect.functions import recorded_calls
from rope_export.exporting import HF_FALLBACKS, HF_TRACES
from rope_export.exporting.core import (
    DTYPES,
    check_opset,
    check_output_writable,
    count_rotary_nodes,
    graph_proto,
    rename_dynamic_dims,
)
from rope_export.exporting.stamping import NotStampable
from rope_export.hf.cache_io import CacheLayout, cache_layout, check_sliding_layers, hf_example_inputs
from rope_export.hf.counting import eager_rotations, refuse_no_rope
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import HFFamily, family_of
from rope_export.hf.hooking import model_state_kept, verified_functions
from rope_export.hf.stamping import census_per_kind, traced_per_kind
from rope_export.hf.tracing import (
    TraceSettings,
    buffer_attention,
    counted_and_written,
    traceable,
    traced_and_fused,
)

# --hf-fallback: what happens when no rotary function verifies. "auto" (default): plain export, then
# fuse. "error": refuse. "plain": no hook and no fusion (RoPE stays decomposed, said as a warning).
# "fuse": skip the hook even if a function verifies (plain export, then fuse).
FALLBACKS = HF_FALLBACKS  # the names live with export's parser, which imports no torch
TRACES = HF_TRACES  # --trace: two decoder layers stamped per layer where proven (default), or every layer


@dataclass(frozen=True)
class HFExportResult:
    model: onnx.ModelProto
    path: Path | None
    family: HFFamily
    hook: str  # what was hooked, or how the rotations were fused
    num_layers: int  # cache layers with keys and values in the file
    kind: str  # "hf-causal-lm" or "hf-attention"
    notes: list[str] = field(default_factory=list)
    rotations: int = 0  # rotations transformers performs in one eager forward
    layout: CacheLayout | None = None
    trace: str = "full"  # "per-kind: ...", "full (per-kind not used: why)" or "full" (rope_export.hf.stamping)

    @property
    def custom_nodes(self) -> int:
        return count_rotary_nodes(self.model)


def export_hf(
    model,
    output: str | os.PathLike | None = None,
    *,
    layer: int | None = None,
    family: str | None = None,
    fallback: str = "auto",
    allow_decomposed: bool = False,
    allow_no_rope: bool = False,
    opset: int = 23,
    weights: str | None = None,
    seed: int = 0,
    example: tuple[int, int, int] | None = None,
    attention_mask: bool = False,
    kv_buffer: bool = False,
    external: str = "auto",
    trace: str = "per-kind",
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> HFExportResult:
    """Export a transformers causal LM (or attention ``layer``) with one rotary node per rotation.

    The rotary function(s) the model calls are found by code and verified numerically, whatever
    its model_type; if none verifies, the plain export is fused. ``family`` (override) insists on a
    registered family's form. ``fallback`` (override): ``"auto"`` (default) as just said,
    ``"error"`` refuses a model without a verified function, ``"plain"`` exports without hook or
    fusion (RoPE stays decomposed: a warning), ``"fuse"`` skips the hook and fuses.

    The rotations transformers performs in one eager forward are compared with the rotary nodes
    of the file: fewer nodes raise ``DecomposedRotationError`` naming the layers left decomposed,
    unless ``allow_decomposed`` (then a warning and a note). ``example`` is (batch, seq, past) of
    the tracing inputs (default (2, 4, 3); (2, 5, 3) for hybrids, whose chunked scans must not see a
    sequence that divides their chunk size); use seq >= 2 (torch.export fixes a dim whose example
    size is 1). ``attention_mask``: the file takes an ``attention_mask`` input [B, past+S] after
    ``position_ids`` (1: a real token, 0: padding), as transformers' ``generate`` passes for padded
    batches; without it every key is attended causally. ``kv_buffer`` (implies ``attention_mask``):
    each past is a preallocated buffer [B, kv_heads, max_length, D] returned updated in place
    (``rope_export.hf.kv_buffer``; opset 24). ``external``: where the weights go
    (``onnx_files.EXTERNAL_DATA``); they are streamed from the model's tensors to disk, never copied
    into one ModelProto. A model that performs no rotation at all (GPT-2) is refused, or with
    ``allow_no_rope`` written with a warning and a note. ``trace``: ``"per-kind"`` (default) traces the leading
    decoder layers (two for a dense model) and stamps the rest (``rope_export.hf.stamping``) where that is
    proven, by structure and by running every stamped layer against transformers' own, else traces every
    layer; ``"full"`` traces every layer; ``HFExportResult.trace`` says which ran and why.
    """
    _refuse_settings(fallback, trace, opset, output)
    settings = TraceSettings(opset=opset, fallback=fallback, seed=seed, attention_mask=attention_mask,
                             kv_buffer=kv_buffer, verbose=verbose, say=progress or (lambda message: None))
    fam = family_of(model, family)
    dtype_name = {v: k for k, v in DTYPES.items()}.get(next(model.parameters()).dtype, "fp32")
    notes: list[str] = []
    plan = _eager_plan(model, fam, layer, example, trace, allow_no_rope, settings, notes)
    program, hook, traced = _traced(model, fam, plan, layer, trace, settings, notes)
    onnx_model = _edited_graph(program, fam.position_rank, plan.layout, settings)
    extra = {"kv_cache": "buffer" if kv_buffer else "concat"} if plan.kind == "hf-causal-lm" else {}  # how the
    # cache is carried: grown by Concat, or buffers updated in place
    onnx_model, report, description = counted_and_written(
        onnx_model, program, model, plan.census, fam, hook, fallback=fallback, allow_decomposed=allow_decomposed,
        notes=notes, metadata=dict(dtype=dtype_name, kind=plan.kind, weights=weights, seed=seed, layer=layer),
        extra=extra, output=output, external=external, say=settings.say)
    return HFExportResult(onnx_model, None if output is None else Path(output), fam, description,
                          len(plan.layout.layers), plan.kind, notes, report.expected, plan.layout, traced)


def _refuse_settings(fallback: str, trace: str, opset: int, output) -> None:
    if fallback not in FALLBACKS:
        raise HFExportError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if trace not in TRACES:
        raise HFExportError(f"trace must be one of {', '.join(TRACES)}, got {trace!r}")
    check_opset(opset)
    if output is not None:
        check_output_writable(Path(output))


@dataclass
class _EagerPlan:
    """What the eager steps found before tracing: the wrapper to trace and its inputs, the rotations, the
    verified rotary functions."""

    layout: CacheLayout
    example: tuple[int, int, int]  # (batch, seq, past) of the tracing inputs
    module: torch.nn.Module  # the wrapper traced in full (the model with its cache, or one attention layer)
    inputs: tuple
    shapes: tuple
    input_names: list[str]
    output_names: list[str]
    kind: str  # "hf-causal-lm" or "hf-attention"
    census: object  # the eager rotations (per kind: the leading layers' census extended by kind)
    functions: list
    counted_per_kind: bool


def _eager_plan(model, fam: HFFamily, layer, example, trace: str, allow_no_rope: bool, settings: TraceSettings,
                notes: list[str]) -> _EagerPlan:
    """Steps 1-3: the cache geometry and tracing inputs, the eager rotations, the verified rotary functions."""
    say, seed = settings.say, settings.seed
    with model_state_kept(model):  # the eager forwards may let transformers cache things on its modules
        layout = cache_layout(model)
        check_sliding_layers(model)
        batch, seq, past = example or ((2, 5, 3) if layout.has_states else (2, 4, 3))
        inputs = hf_example_inputs(model, batch=batch, seq=seq, past=past, seed=seed,
                                   position_rank=fam.position_rank, layout=layout,
                                   attention_mask=(settings.attention_mask or settings.kv_buffer) and layer is None)
        module, inputs, shapes, input_names, output_names, kind = traceable(
            model, layer, inputs, layout, fam.position_rank, seed, settings.attention_mask, settings.kv_buffer)
        counted = None  # per-kind: the leading layers' census, extended by kind (rope_export.hf.stamping)
        if trace == "per-kind" and layer is None:
            counted = census_per_kind(model, fam.position_rank, layout, (batch, seq, past), seed, say)
        if counted is None:
            say("counting the rotations transformers performs in one eager forward")
            with recorded_calls() as called, buffer_attention(model, settings.kv_buffer):
                census = eager_rotations(module, inputs)
        else:
            census, called = counted
        refuse_no_rope(census, model.config.model_type if layer is None else f"{model.config.model_type} layer {layer}",
                       allow_no_rope=allow_no_rope, notes=notes)
        say("finding the rotary functions the model calls")
        functions = verified_functions(model, fam, called, settings.fallback)
    return _EagerPlan(layout, (batch, seq, past), module, inputs, shapes, input_names, output_names, kind, census,
                      functions, counted is not None)


def _traced(model, fam: HFFamily, plan: _EagerPlan, layer, trace: str, settings: TraceSettings, notes: list[str]):
    """Step 4: (program, hook, what ran): traced per kind where that is proven, else every layer (then, after a
    per-kind census, the rotations are counted again over every layer: ``plan.census`` is replaced)."""
    say = settings.say
    traced = "full"
    if trace == "per-kind":
        why = "--layer exports (one attention layer) are traced in full" if layer is not None else ""
        if not why:
            try:
                return traced_per_kind(model, fam, plan.functions, plan.census, plan.layout,
                                       (plan.input_names, plan.output_names), plan.example, settings, notes)
            except NotStampable as exc:
                why = str(exc)
        traced = f"full (per-kind not used: {why})"
        say(f"tracing every layer: {why}")
        if plan.counted_per_kind:  # the full trace is compared with every layer's own rotations
            say("counting the rotations transformers performs in one eager forward")
            with model_state_kept(model):
                plan.census = eager_rotations(plan.module, plan.inputs)
    say(f"exporting {type(model).__name__} ({plan.kind}, {len(plan.layout.layers)} cache layers) with torch.export")
    program, hook = traced_and_fused(model, plan.module, plan.inputs, plan.shapes, plan.input_names,
                                     plan.output_names, fam=fam, functions=plan.functions, census=plan.census,
                                     opset=settings.opset, fallback=settings.fallback, notes=notes,
                                     verbose=settings.verbose, say=say, layout=plan.layout,
                                     kv_buffer=settings.kv_buffer)
    return program, hook, traced


def _edited_graph(program, position_rank: int, layout: CacheLayout, settings: TraceSettings) -> onnx.ModelProto:
    """The graph to edit (the weights stay in torch until finish_export): dims checked and named; a KV buffer's
    updates in standard ops."""
    onnx_model = graph_proto(program)
    _check_dynamic(onnx_model, position_rank)
    _name_dims(onnx_model, position_rank, layout, settings.attention_mask or settings.kv_buffer)
    if settings.kv_buffer:
        from rope_export.hf.kv_buffer import name_buffer_dims, to_standard_ops

        to_standard_ops(onnx_model)
        name_buffer_dims(onnx_model)
    return onnx_model


def _check_dynamic(model: onnx.ModelProto, position_rank: int) -> None:
    """torch.export silently fixes a dim whose example size is 1; refuse such a file."""
    dims = model.graph.input[1].type.tensor_type.shape.dim
    offset = 1 if position_rank == 3 else 0
    for axis, name in ((offset, "batch"), (offset + 1, "seq")):
        if not dims[axis].dim_param:
            raise HFExportError(
                f"the exported file has a fixed {name} of {dims[axis].dim_value}: torch.export specialised it to the "
                f"example; export with an example whose {name} is at least 2 (example=(batch, seq, past))"
            )


def _name_dims(model: onnx.ModelProto, position_rank: int, layout: CacheLayout, attention_mask: bool = False) -> None:
    """batch/seq/past names for the I/O's symbolic dims (past+seq on the presents and the attention mask)."""
    first_kv = next((n for n, axis in enumerate(layout.past_axes()) if axis == 2), None)
    first_past = 3 if attention_mask else 2
    rename_dynamic_dims(model, batch_seq=(1, 1 if position_rank == 3 else 0),
                        past=None if first_kv is None else first_past + first_kv)
    if attention_mask:  # torch names the mask's length a symbol of its own (past+seq is not a Dim it can declare)
        total = model.graph.input[2].type.tensor_type.shape.dim[1]
        old, total.dim_param = total.dim_param, "past+seq"
        for value in [*model.graph.input, *model.graph.output]:
            for dim in value.type.tensor_type.shape.dim:
                if old and dim.dim_param == old:
                    dim.dim_param = "past+seq"
    ids_seq = model.graph.input[0].type.tensor_type.shape.dim[1]
    if ids_seq.dim_param and ids_seq.dim_param != "seq":  # torch left input_ids' seq a symbol of its own
        old = ids_seq.dim_param
        for value in [*model.graph.input, *model.graph.output]:
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param == old:
                    dim.dim_param = "seq"
