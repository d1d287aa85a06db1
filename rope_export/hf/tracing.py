"""Tracing a transformers model to ONNX, whatever its task: the pieces every ``rope_export.hf`` export shares.

``traceable`` wraps a causal LM (or one attention layer) with its cache as the file's inputs and outputs;
``trace_onnx`` runs torch.export and torch.onnx with the rotary op's translation; ``traced_and_fused`` does so
with the verified rotary functions routed through the op and fuses what no hook reached; ``counted_and_written``
compares the eager rotations with the file's rotary nodes, stamps the metadata and writes the file atomically;
``export_failure`` turns torch.export's and onnxscript's errors into one line naming the model and the cause.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import onnx
import torch

from rope_export import __version__
from rope_export.detect import rotary_nodes
from rope_export.exporting import precision
from rope_export.exporting.core import (
    INPUT_NAMES,
    METADATA_PREFIX,
    OUTPUT_NAMES,
    custom_translation_table,
    finish_export,
)
from rope_export.exporting.torch_onnx import quiet_exporter
from rope_export.hf.cache_io import AttentionWithCache, CacheLayout, CausalLMWithCache, hf_io_names
from rope_export.hf.counting import count_and_compare
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import HFFamily, text_config
from rope_export.hf.hooking import HookState, model_state_kept, rotary_hooked
from rope_export.hf.metadata import hf_metadata


@dataclass(frozen=True)
class TraceSettings:
    """How one export traces, whatever is traced (the whole model, one layer, the model cut per kind)."""

    opset: int = 23
    fallback: str = "auto"  # FALLBACKS: what happens when no rotary function verifies
    seed: int = 0
    attention_mask: bool = False
    kv_buffer: bool = False
    verbose: bool = False
    say: Callable[[str], None] = lambda message: None  # progress lines


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


def export_failure(model, exc: Exception, layout: CacheLayout | None) -> HFExportError:
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


def trace_onnx(module, inputs, dynamic_shapes, input_names, output_names, opset, verbose, progress=None, extra=None):
    """torch.onnx's ONNXProgram: its onnx_ir model refers to the torch tensors without copying them."""
    with torch.no_grad(), quiet_exporter(verbose, progress):
        return torch.onnx.export(
            module, tuple(inputs), dynamo=True, opset_version=opset, input_names=input_names,
            output_names=output_names, dynamic_shapes=dynamic_shapes,
            custom_translation_table={**custom_translation_table(), **(extra or {})}, verbose=True if verbose else None,
        )


def fuse_unreached(program, notes: list[str], hooked: bool = False) -> None:
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


def traceable(model, layer, inputs, layout, position_rank, seed, attention_mask=False, kv_buffer=False):
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


def traced_and_fused(model, module, inputs, shapes, input_names, output_names, *, fam: HFFamily, functions,
                     census, opset: int, fallback: str, notes: list[str], verbose: bool, say,
                     layout: CacheLayout | None = None, kv_buffer: bool = False):
    """(program, hook): ``module`` (a wrapper of ``model``) traced by torch.export with the verified rotary
    ``functions`` routed through the op, the model kept as it was; the rotations no hook reached are fused
    (unless ``fallback`` is "plain"). Any export of a transformers model, whatever its task, goes through here."""
    hook_ctx = rotary_hooked(model, family=fam, functions=functions) if functions else contextlib.nullcontext()
    try:
        with model_state_kept(model), hook_ctx as hook, buffer_attention(model, kv_buffer):
            program = trace_onnx(module, inputs, shapes, input_names, output_names, opset, verbose, say,
                              extra=buffer_translations(kv_buffer))
    except HFExportError:
        raise
    except Exception as exc:  # torch.export / onnxscript errors: name the model and the op, keep the cause
        raise export_failure(model, exc, layout) from exc
    if fallback != "plain" and (hook is None or len(rotary_nodes(program.model)) < len(census.plain)):
        fuse_unreached(program, notes, hooked=hook is not None)  # what no hook reached is fused
    precision.state_norm_precision(program.model)  # float32 norm statistics in the types (exporting.precision)
    return program, hook


def counted_and_written(onnx_model: onnx.ModelProto, program, model, census, fam: HFFamily, hook, *, fallback: str,
                        allow_decomposed: bool, notes: list[str], metadata: dict, extra: dict, output, external: str,
                        say) -> tuple[onnx.ModelProto, object, str]:
    """(the file's ModelProto, the count report, the hook's description): the eager rotations compared with the
    file's rotary nodes (a shortfall is an error unless allowed), the metadata (``hf_metadata``'s keywords in
    ``metadata``, more keys in ``extra``), then the atomic write (``finish_export``)."""
    description = describe_hook(hook, fallback)
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


def buffer_attention(model, kv_buffer: bool):
    if not kv_buffer:
        return contextlib.nullcontext()
    from rope_export.hf.kv_buffer import buffer_attention_set

    return buffer_attention_set(model)


def buffer_translations(kv_buffer: bool) -> dict:
    if not kv_buffer:
        return {}
    from rope_export.hf.kv_buffer import custom_translation_table as buffer_table

    return buffer_table()


def describe_hook(hook: HookState | None, fallback: str) -> str:
    if hook is not None:
        return hook.description
    if fallback == "plain":
        return "none (plain export: RoPE decomposed)"
    return "none (no rotary function verified): plain export fused by rope_export.passes.fuse"
