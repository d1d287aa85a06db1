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

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from rope_export import __version__
from rope_export.detect import rotary_nodes
from rope_export.detect.functions import recorded_calls
from rope_export.exporting import HF_FALLBACKS, HF_TRACES
from rope_export.exporting.core import (
    DTYPES,
    INPUT_NAMES,
    METADATA_PREFIX,
    OUTPUT_NAMES,
    check_opset,
    check_output_writable,
    count_rotary_nodes,
    custom_translation_table,
    finish_export,
    graph_proto,
    rename_dynamic_dims,
)
from rope_export.exporting.precision import state_norm_precision
from rope_export.exporting.stamping import NotStampable, stamp, traced_count, weights_kept_apart
from rope_export.exporting.torch_onnx import quiet_exporter
from rope_export.hf.cache_io import (
    AttentionWithCache,
    CacheLayout,
    CausalLMWithCache,
    cache_layout,
    check_sliding_layers,
    hf_example_inputs,
    hf_io_names,
)
from rope_export.hf.counting import count_and_compare, eager_rotations, refuse_no_rope
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import HFFamily, family_of, text_config
from rope_export.hf.hooking import HookState, model_state_kept, rotary_hooked, verified_functions
from rope_export.hf.layer_proof import LayerMismatch
from rope_export.hf.metadata import hf_metadata
from rope_export.hf.stamping import census_per_kind, layer_kinds, prove_decoder_layers, reduced

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


def _dims(states: bool = False):
    """batch, seq, past. With recurrent states, seq is left to torch: their layers branch on seq == 1
    (a one-token update), and the traced multi-token path also computes one token right (the zoo
    checks a decode step), so torch may assume seq >= 2 while tracing it."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim.DYNAMIC if states else torch.export.Dim("seq", min=1, max=2**20)
    past = torch.export.Dim("past", min=0, max=2**20)
    return batch, seq, past


_UNSUPPORTED_OP = re.compile(r"(?:torch\.ops\.)?[A-Za-z_][\w]*\.[A-Za-z_]\w*\.(?:default|Tensor|\w+)\b")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _chain(exc: BaseException) -> list[BaseException]:
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


_NO_FUNCTION = re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'\)>")
_STATIC_SEQ = re.compile(r"inferred a static shape of (\d+) for dimension inputs\['input_ids'\]\.shape\[1\]")
_DATA_DEPENDENT = "GuardOnDataDependentSymNode"
# torch.export's "Constraints violated (past)! ... Not all values of past = L['past'][0].size()[2] in
# the specified range past <= 1048576 satisfy the generated guard L['past'][0].size()[2] <= 3"
_CONSTRAINED = re.compile(r"Constraints violated \((\w+)\)!.*?Not all values of \w+ = (\S+) in the specified range"
                          r".*? satisfy the generated guard ([^\n]+)", re.S)


def _state_layers(model, layout: CacheLayout) -> str:
    types = getattr(text_config(model.config), "layer_types", None) or []
    named = [f"{io.index} ({types[io.index]!r})" if io.index < len(types) else str(io.index)
             for io in layout.layers if io.has_states]
    return ", ".join(named)


def _export_failure(model, exc: Exception, layout: CacheLayout | None) -> HFExportError:
    """One line naming the model and the innermost cause; an operator torch.onnx cannot translate is named."""
    chain = _chain(exc)
    text = _ANSI.sub("", "\n".join(str(e) for e in chain))
    missing = sorted({f"torch.ops.{m.group(1)}.{m.group(2)}" for m in _NO_FUNCTION.finditer(text)})
    if missing:
        return HFExportError(f"exporting {type(model).__name__} failed: torch.onnx cannot translate "
                             f"{', '.join(missing)} (no ONNX function is registered for it)")
    constrained = _CONSTRAINED.search(text)
    if constrained:  # found before torch's own attempt to refine the shapes fails on the way out
        dim, expression, guard = constrained.groups()
        return HFExportError(
            f"exporting {type(model).__name__} failed: while tracing, its code restricts the dynamic dimension "
            f"{dim!r} to {guard.replace(expression, dim).strip()} (torch.export's guard), so no file could serve "
            f"every {dim}")
    static = _STATIC_SEQ.search(text)
    if static:
        where = f" in its recurrent layers {_state_layers(model, layout)}" if layout and layout.has_states else ""
        return HFExportError(
            f"exporting {type(model).__name__} failed: its code fixes the sequence length to the example's "
            f"{static.group(1)} while tracing (a Python loop or branch over the tokens{where}), so no file could "
            "serve other lengths")
    if _DATA_DEPENDENT in text:
        return HFExportError(
            f"exporting {type(model).__name__} failed: its code branches on tensor values (e.g. a mixture-of-experts "
            "loop over the experts a batch hits), which torch.export cannot trace")
    for line in text.splitlines():
        if "Unsupported FX nodes" in line or "no translation" in line.lower() or "not supported" in line.lower():
            ops = sorted({m.group(0) for m in _UNSUPPORTED_OP.finditer(line)} - {"torch.onnx.export"})
            if ops:
                return HFExportError(f"exporting {type(model).__name__} failed: torch.onnx cannot translate "
                                     f"{', '.join(ops)}")
    innermost = chain[-1]
    lines = [line.strip() for line in _ANSI.sub("", str(innermost)).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return HFExportError(f"exporting {type(model).__name__} failed: {type(innermost).__name__}: {first[:300]}")


def _export(module, inputs, dynamic_shapes, input_names, output_names, opset, verbose, progress=None, extra=None):
    """torch.onnx's ONNXProgram: its onnx_ir model refers to the torch tensors without copying them."""
    with torch.no_grad(), quiet_exporter(verbose, progress):
        return torch.onnx.export(
            module, tuple(inputs), dynamo=True, opset_version=opset, input_names=input_names,
            output_names=output_names, dynamic_shapes=dynamic_shapes,
            custom_translation_table={**custom_translation_table(), **(extra or {})}, verbose=True if verbose else None,
        )


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


def _fuse(program, notes: list[str], hooked: bool = False) -> None:
    """rope_export.passes.fuse on the traced program's onnx_ir model, in place: the sites are verified
    on the real constants (the torch tensors, not copied); torch.onnx's ai.onnx RotaryEmbedding nodes adopted."""
    from rope_export.passes import FusionReport, fuse

    def ours() -> int:
        return sum(node.kind == "rope_export" for node in rotary_nodes(program.model))

    before = ours()
    fuse(program.model, report=FusionReport(), adopt_standard=True)
    made = ours() - before
    notes.append(f"rotations the hooked functions did not reach: rope_export.passes.fuse made {made} rotary node(s)"
                 if hooked else f"no rotary function verified: exported plain, rope_export.passes.fuse made {made} "
                 "rotary node(s)")


def _wrapper(model, layer, inputs, layout, position_rank, seed, attention_mask=False, kv_buffer=False):
    """(module to trace, its inputs, dynamic shapes, input names, output names, kind)."""
    b, s, p = _dims(layout.has_states)
    pos_shape = {1: b, 2: s} if position_rank == 3 else {0: b, 1: s}
    if kv_buffer:
        from rope_export.hf.kv_buffer import CausalLMWithKVBuffer, example_buffers

        if layer is not None:
            raise HFExportError("a KV buffer export is for whole models; --layer exports take none")
        input_names, output_names = hf_io_names(layout, attention_mask=True)
        m = torch.export.Dim("max_length", min=2, max=2**20)
        buffers = tuple({0: b, 2: m} for _ in layout.past_axes())
        shapes = ({0: b, 1: s}, pos_shape, {0: b, 1: torch.export.Dim.DYNAMIC}, buffers)
        return (CausalLMWithKVBuffer(model, layout).eval(), example_buffers(model, layout, inputs), shapes,
                input_names, output_names, "hf-causal-lm")
    if layer is None:
        input_names, output_names = hf_io_names(layout, attention_mask=attention_mask)
        past = tuple({0: b} if axis is None else {0: b, axis: p} for axis in layout.past_axes())
        # The mask's length is past+seq; torch.export cannot declare a sum of two Dims, so it infers it.
        mask = ({0: b, 1: torch.export.Dim.DYNAMIC},) if attention_mask else ()
        module = CausalLMWithCache(model, layout, attention_mask=attention_mask).eval()
        return (module, inputs, ({0: b, 1: s}, pos_shape, (*mask, *past)), input_names, output_names, "hf-causal-lm")
    if attention_mask:
        raise HFExportError("an attention_mask input is for whole models; --layer exports take none")
    module = AttentionWithCache(model, layer).eval()
    index = module.attention.layer_idx
    slot = next((n for n, io in enumerate(layout.layers) if io.index == index), None)
    if slot is None or any(io.names() != ["key", "value"] for io in layout.layers[: slot + 1]):
        raise HFExportError(f"attention layer {layer} keeps no plain keys and values of its own (shared, or with an "
                            "indexer cache or states); export the whole model")
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(inputs[0].shape[0], inputs[0].shape[1], text_config(model.config).hidden_size,
                         generator=generator).to(inputs[2].dtype)
    layer_inputs = (hidden, inputs[1], inputs[2 + 2 * slot], inputs[3 + 2 * slot])
    shapes = ({0: b, 1: s}, pos_shape, {0: b, 2: p}, {0: b, 2: p})
    return module, layer_inputs, shapes, list(INPUT_NAMES), list(OUTPUT_NAMES), "hf-attention"


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
    say = progress or (lambda message: None)
    if fallback not in FALLBACKS:
        raise HFExportError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if trace not in TRACES:
        raise HFExportError(f"trace must be one of {', '.join(TRACES)}, got {trace!r}")
    check_opset(opset)
    if output is not None:
        check_output_writable(Path(output))
    fam = family_of(model, family)
    dtype_name = {v: k for k, v in DTYPES.items()}.get(next(model.parameters()).dtype, "fp32")
    notes: list[str] = []
    with model_state_kept(model):  # the eager forwards may let transformers cache things on its modules
        layout = cache_layout(model)
        check_sliding_layers(model)
        batch, seq, past = example or ((2, 5, 3) if layout.has_states else (2, 4, 3))
        inputs = hf_example_inputs(model, batch=batch, seq=seq, past=past, seed=seed,
                                   position_rank=fam.position_rank, layout=layout,
                                   attention_mask=(attention_mask or kv_buffer) and layer is None)
        module, inputs, shapes, input_names, output_names, kind = _wrapper(model, layer, inputs, layout,
                                                                            fam.position_rank, seed, attention_mask,
                                                                            kv_buffer)
        counted = None  # per-kind: the leading layers' census, extended by kind (rope_export.hf.stamping)
        if trace == "per-kind" and layer is None:
            counted = census_per_kind(model, fam.position_rank, layout, (batch, seq, past), seed, say)
        if counted is None:
            say("counting the rotations transformers performs in one eager forward")
            with recorded_calls() as called, _buffer_attention(model, kv_buffer):
                census = eager_rotations(module, inputs)
        else:
            census, called = counted
        refuse_no_rope(census, model.config.model_type if layer is None else f"{model.config.model_type} layer {layer}",
                       allow_no_rope=allow_no_rope, notes=notes)
        say("finding the rotary functions the model calls")
        functions = verified_functions(model, fam, called, fallback)
    program, traced = None, "full"
    if trace == "per-kind":
        why = "--layer exports (one attention layer) are traced in full" if layer is not None else ""
        if not why:
            try:
                program, hook, traced = _per_kind(model, fam, functions, census, layout, input_names, output_names,
                                                  (batch, seq, past), seed, opset, fallback, notes, verbose, say,
                                                  attention_mask, kv_buffer)
            except NotStampable as exc:
                why = str(exc)
        if program is None:
            traced = f"full (per-kind not used: {why})"
            say(f"tracing every layer: {why}")
            if counted is not None:  # the full trace is compared with every layer's own rotations
                say("counting the rotations transformers performs in one eager forward")
                with model_state_kept(model):
                    census = eager_rotations(module, inputs)
    if program is None:
        say(f"exporting {type(model).__name__} ({kind}, {len(layout.layers)} cache layers) with torch.export")
        program, hook = traced_and_fused(model, module, inputs, shapes, input_names, output_names, fam=fam,
                                         functions=functions, census=census, opset=opset, fallback=fallback,
                                         notes=notes, verbose=verbose, say=say, layout=layout, kv_buffer=kv_buffer)
    onnx_model = graph_proto(program)  # the graph to edit; the weights stay in torch until finish_export
    _check_dynamic(onnx_model, fam.position_rank)
    _name_dims(onnx_model, fam.position_rank, layout, attention_mask or kv_buffer)
    if kv_buffer:
        from rope_export.hf.kv_buffer import name_buffer_dims, to_standard_ops

        to_standard_ops(onnx_model)
        name_buffer_dims(onnx_model)
    extra = {"kv_cache": "buffer" if kv_buffer else "concat"} if kind == "hf-causal-lm" else {}  # how the cache
    # is carried: grown by Concat, or buffers updated in place
    onnx_model, report, description = counted_and_written(
        onnx_model, program, model, census, fam, hook, fallback=fallback, allow_decomposed=allow_decomposed,
        notes=notes, metadata=dict(dtype=dtype_name, kind=kind, weights=weights, seed=seed, layer=layer),
        extra=extra, output=output, external=external, say=say)
    return HFExportResult(onnx_model, None if output is None else Path(output), fam, description, len(layout.layers),
                          kind, notes, report.expected, layout, traced)


def traced_and_fused(model, module, inputs, shapes, input_names, output_names, *, fam: HFFamily, functions,
                     census, opset: int, fallback: str, notes: list[str], verbose: bool, say,
                     layout: CacheLayout | None = None, kv_buffer: bool = False):
    """(program, hook): ``module`` (a wrapper of ``model``) traced by torch.export with the verified rotary
    ``functions`` routed through the op, the model kept as it was; the rotations no hook reached are fused
    (unless ``fallback`` is "plain"). Any export of a transformers model, whatever its task, goes through here."""
    hook_ctx = rotary_hooked(model, family=fam, functions=functions) if functions else contextlib.nullcontext()
    try:
        with model_state_kept(model), hook_ctx as hook, _buffer_attention(model, kv_buffer):
            program = _export(module, inputs, shapes, input_names, output_names, opset, verbose, say,
                              extra=_buffer_translations(kv_buffer))
    except HFExportError:
        raise
    except Exception as exc:  # torch.export / onnxscript errors: name the model and the op, keep the cause
        raise _export_failure(model, exc, layout) from exc
    if fallback != "plain" and (hook is None or len(rotary_nodes(program.model)) < len(census.plain)):
        _fuse(program, notes, hooked=hook is not None)  # what no hook reached is fused
    state_norm_precision(program.model)  # float32 norm statistics in the types (rope_export.exporting.precision)
    return program, hook


def counted_and_written(onnx_model: onnx.ModelProto, program, model, census, fam: HFFamily, hook, *, fallback: str,
                        allow_decomposed: bool, notes: list[str], metadata: dict, extra: dict, output, external: str,
                        say) -> tuple[onnx.ModelProto, object, str]:
    """(the file's ModelProto, the count report, the hook's description): the eager rotations compared with the
    file's rotary nodes (a shortfall is an error unless allowed), the metadata (``hf_metadata``'s keywords in
    ``metadata``, more keys in ``extra``), then the atomic write (``finish_export``)."""
    description = _describe(hook, fallback)
    say("comparing the eager rotations with the file's rotary nodes")
    report = count_and_compare(census, onnx_model, allow_decomposed=allow_decomposed or fallback == "plain",
                               notes=notes, stacklevel=4)
    props = hf_metadata(model, fam, hook_description=description,
                        interleaved=hook.interleaved if hook is not None else False, **metadata)
    props |= {METADATA_PREFIX + key: value for key, value in
              {"rotations_eager": str(report.expected), "rotary_nodes": str(report.found), **extra}.items()}
    for key, value in props.items():
        onnx_model.metadata_props.add(key=key, value=value)
    onnx_model.producer_name, onnx_model.producer_version = "rope-export", __version__
    return finish_export(onnx_model, program, output, external=external, progress=say), report, description


def _buffer_attention(model, kv_buffer: bool):
    if not kv_buffer:
        return contextlib.nullcontext()
    from rope_export.hf.kv_buffer import buffer_attention_set

    return buffer_attention_set(model)


def _buffer_translations(kv_buffer: bool) -> dict:
    if not kv_buffer:
        return {}
    from rope_export.hf.kv_buffer import custom_translation_table as buffer_table

    return buffer_table()


def _describe(hook: HookState | None, fallback: str) -> str:
    if hook is not None:
        return hook.description
    if fallback == "plain":
        return "none (plain export: RoPE decomposed)"
    return "none (no rotary function verified): plain export fused by rope_export.passes.fuse"


def _per_kind(model, fam, functions, census, layout, input_names, output_names, example, seed, opset, fallback,
              notes, verbose, say, attention_mask=False, kv_buffer=False):
    """(program, hook, what ran): the model cut to its leading decoder layers (each kind at least once past
    layer 0), traced, fused, stamped per layer; the rotary nodes per layer must equal transformers' rotations
    per layer. NotStampable says why not."""
    import warnings

    from rope_export.detect import compare_with_file

    kinds = layer_kinds(model, layout)
    n, traced = len(kinds), traced_count(kinds)
    batch, seq, past = example
    hook_ctx = rotary_hooked(model, family=fam, functions=functions) if functions else contextlib.nullcontext()
    say(f"exporting {type(model).__name__} cut to {traced} of its {n} decoder layers with torch.export "
        f"({len(set(kinds))} kind(s) of layer)")
    try:
        with model_state_kept(model), reduced(model, traced) as layers_name, hook_ctx as hook, \
                weights_kept_apart(layers_name), _buffer_attention(model, kv_buffer):
            small = cache_layout(model)
            inputs = hf_example_inputs(model, batch=batch, seq=seq, past=past, seed=seed,
                                       position_rank=fam.position_rank, layout=small,
                                       attention_mask=attention_mask or kv_buffer)
            module, inputs, shapes, names_in, names_out, _ = _wrapper(model, None, inputs, small, fam.position_rank,
                                                                     seed, attention_mask, kv_buffer)
            program = _export(module, inputs, shapes, names_in, names_out, opset, verbose, say,
                              extra=_buffer_translations(kv_buffer))
            prefix = next(name for name, m in module.named_modules() if m is model) + "."
    except Exception as exc:  # noqa: BLE001 - whatever fails on two layers is left to the full trace to report
        raise NotStampable(f"the {traced}-layer trace failed ({type(exc).__name__})") from exc
    want = census.by_layer(census.plain)
    if fallback != "plain" and (hook is None or len(rotary_nodes(program.model)) <
                                sum(c for layer, c in want.items() if layer is None or layer < traced)):
        _fuse(program, notes, hooked=hook is not None)
    state_norm_precision(program.model)  # before stamping, which copies them (rope_export.exporting.precision)
    say(f"stamping the traced layers {n - traced} times with each layer's weights and cache")
    stamped = stamp(program.model, model, layers_name=layers_name, onnx_prefix=prefix, kinds=kinds,
                    input_names=input_names, output_names=output_names)
    added = sum(len(layer.nodes) for layer in stamped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            report = compare_with_file(census, program.model, allow_decomposed=True)
        except Exception as exc:  # noqa: BLE001 - more nodes than rotations
            raise NotStampable(f"the stamped file's rotary nodes disagree with transformers ({exc})") from exc
    if not report.layers or any(w != h for w, h in report.layers.values()):
        raise NotStampable("the stamped file's rotary nodes per layer differ from transformers' rotations per layer")
    try:
        proof = prove_decoder_layers(program.model, model, layout, stamped, kinds, position_rank=fam.position_rank,
                                     attention_mask=attention_mask, kv_buffer=kv_buffer, seed=seed, example=example,
                                     progress=say)
    except LayerMismatch as exc:
        raise NotStampable(str(exc)) from exc
    return program, hook, (f"per-kind: {traced} of {n} decoder layers traced and counted ({len(set(kinds))} kind(s)), "
                           f"{n - traced} stamped ({added} nodes); {proof.describe()}")
