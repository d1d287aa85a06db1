"""The per-kind trace for transformers' decoders: ``rope_export.exporting.stamping`` on a causal LM's layers.

What is particular to a decoder: its layers are the one ``ModuleList`` named ``layers`` of
``num_hidden_layers`` modules (``decoder_layers``); two layers are one kind when, besides what
``group_layers`` compares, their ``layer_types`` entry and cache slots are the same, and only one
key/value pair per layer is stamped (recurrent and indexer caches: the full trace so far); the
model is cut with its config (``reduced``); the rotations are counted in an eager forward of the
traced layers and extended by kind (``census_per_kind``); and every stamped layer is proven against
transformers' own (``prove_decoder_layers``: ``rope_export.hf.layer_proof`` with the model's
forward run on ``CausalLMWithCache``'s inputs: the first stamped layer of each kind at two cache lengths, one
on each side of the traced example's past+seq, each later one once, at positions on both sides of it; with
a KV buffer, the buffers holding that past).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch

from rope_export.detect import rotary_nodes
from rope_export.exporting import precision
from rope_export.exporting.stamping import (
    MIN_LAYERS,
    NotStampable,
    StampedLayer,
    cut_layers,
    group_layers,
    stamp,
    templates_of,
    traced_count,
    weights_kept_apart,
)
from rope_export.hf.cache_io import CausalLMWithCache, cache_layout, hf_example_inputs, hf_io_names
from rope_export.hf.families import text_config
from rope_export.hf.hooking import model_state_kept, rotary_hooked
from rope_export.hf.layer_proof import (
    Case,
    LayerMismatch,
    Proof,
    alone,
    numpy_of,
    prove_layers,
    run_stopped,
)
from rope_export.hf.tracing import (
    TraceSettings,
    buffer_attention,
    buffer_translations,
    fuse_unreached,
    trace_onnx,
    traceable,
)


def proof_cases(example: tuple[int, int, int]) -> tuple[tuple[int, int, int], ...]:
    """(batch, seq, past) of the layer proof around the traced example's past+seq T (7 for export_hf's default
    (2, 4, 3)): past 1 with 2 new tokens and past T+2 with 3 (past+seq 3 and T+5), the first stamped layer of
    each kind's graph on either side of T (T+5 = 12 is past the quick zoo's sliding windows of 4, so a sliding
    layer is proven past its window too); and for each later layer (``LATER_CASES``) one row, past 1 with T new
    tokens: its queries see 2 to T+1 keys, on both sides of T and past those windows. One row of few tokens,
    because a later layer's cost is its eager runs: at 2 rows of T+4 tokens a 1B fp32 layer's matrix products
    cost 4 times as much as at 4 tokens (one thread, compute no longer hidden by reading the weights)."""
    total = example[1] + example[2]
    return (2, 2, 1), (2, 3, total + 2), (1, total, 1)


FIRST_CASES, LATER_CASES = (0, 1), (2,)  # indices into proof_cases(): which the first layer of a kind, a later one run


def decoder_layers(model) -> tuple[torch.nn.Module, str, torch.nn.ModuleList, str]:
    """(the module holding the decoder layers, its attribute, the ModuleList, its qualified name)."""
    n = getattr(text_config(model.config), "num_hidden_layers", None)
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == n and name.rsplit(".", 1)[-1] == "layers"]
    if len(found) != 1:
        raise NotStampable(f"no single ModuleList 'layers' of num_hidden_layers={n} modules")
    name, layers = found[0]
    parent_name, _, attribute = name.rpartition(".")
    return model.get_submodule(parent_name), attribute, layers, name


def layer_kinds(model, layout) -> list[int]:
    """Each decoder layer's kind (the index of the first layer like it); NotStampable when layers cannot
    be grouped or nothing would be gained."""
    _, _, layers, _ = decoder_layers(model)
    if len(layers) < MIN_LAYERS:
        raise NotStampable(f"{len(layers)} decoder layers: the full trace is as short")
    if [io.index for io in layout.layers] != list(range(len(layers))):
        raise NotStampable("the cache layers are not one per decoder layer")
    if any(set(io.names()) - {"key", "value"} for io in layout.layers):
        raise NotStampable("layers with recurrent or indexer caches are traced in full so far")
    types = list(getattr(text_config(model.config), "layer_types", None) or [None] * len(layers))
    extras = [(types[i] if i < len(types) else None, tuple((s.name, s.shape, s.past_axis) for s in io.slots))
              for i, io in enumerate(layout.layers)]
    return group_layers(layers, extras)


def census_by_kind(census, kinds: list[int]):
    """The census of one eager forward of the leading ``traced_count(kinds)`` layers, extended to every layer:
    a later layer rotates what the traced layer it is stamped from rotates (the stamping's own premise), at
    its own module path; a note says which layers were counted and which inferred. Rotations outside the
    numbered layers are kept as counted."""
    from dataclasses import replace

    from rope_export.detect.witness import RotationCensus

    traced, n = traced_count(kinds), len(kinds)
    source = templates_of(kinds)
    sites = list(census.sites)
    first_number = re.compile(r"(?<![^.])\d+(?![^.])")
    for layer in range(traced, n):
        j = source[kinds[layer]]
        sites += [replace(site, layer=layer, module_path=first_number.sub(str(layer), site.module_path, count=1))
                  for site in census.sites if site.layer == j]
    note = (f"rotations counted in one eager forward of decoder layers 0-{traced - 1}; layers {traced}-{n - 1} "
            "rotate what the traced layer of their kind rotates (per-kind)")
    return RotationCensus(sites, [*census.notes, note])


def census_per_kind(model, position_rank: int, layout, example, seed: int, say):
    """(census, functions called) from one eager forward of the leading decoder layers the per-kind trace
    traces, extended to every layer by kind (``census_by_kind``); None when the layers cannot be grouped
    (the full census is taken, and the full trace says why). The eager forward of a 32-layer 8B model took
    21.5 s of its per-kind export; this one runs the layers the trace runs."""
    from rope_export.detect.functions import recorded_calls
    from rope_export.hf.counting import eager_rotations

    try:
        kinds = layer_kinds(model, layout)
    except NotStampable:
        return None
    traced = traced_count(kinds)
    batch, seq, past = example
    say(f"counting the rotations transformers performs in one eager forward of the {traced} leading decoder layers")
    with model_state_kept(model), reduced(model, traced):
        small = cache_layout(model)
        inputs = hf_example_inputs(model, batch=batch, seq=seq, past=past, seed=seed, position_rank=position_rank,
                                   layout=small)
        with recorded_calls() as called:
            census = eager_rotations(CausalLMWithCache(model, small).eval(), inputs)
    return census_by_kind(census, kinds), called


@contextlib.contextmanager
def reduced(model, keep: int = 2) -> Iterator[str]:
    """The model cut to its first ``keep`` decoder layers (config too); yields the layers' qualified name."""
    holder, attribute, _, name = decoder_layers(model)
    config = text_config(model.config)
    saved_types = getattr(config, "layer_types", None)
    saved_n = config.num_hidden_layers
    config.num_hidden_layers = keep
    if saved_types is not None:
        config.layer_types = list(saved_types)[:keep]
    try:
        with cut_layers(holder, attribute, keep):
            yield name
    finally:
        config.num_hidden_layers = saved_n
        if saved_types is not None:
            config.layer_types = saved_types


def prove_decoder_layers(program_model, model, layout, stamped: list[StampedLayer], kinds: list[int], *,
                         position_rank: int, attention_mask: bool = False, kv_buffer: bool = False, seed: int = 0,
                         example: tuple[int, int, int],
                         progress: Callable[[str], None] | None = None) -> Proof:
    """Every stamped decoder layer of ``program_model`` against transformers' own (``layer_proof.prove_layers``)
    at ``proof_cases(example)`` (``example``: what was traced); LayerMismatch names the first that differs."""
    from rope_export.hf.cache_io import _slot_tensor

    _, _, layers, _ = decoder_layers(model)
    mask = attention_mask or kv_buffer
    names, _ = hf_io_names(layout, attention_mask=mask)
    shapes = proof_cases(example)
    inputs = [hf_example_inputs(model, batch=b, seq=s, past=p, seed=seed + n, position_rank=position_rank,
                                layout=layout, attention_mask=mask) for n, (b, s, p) in enumerate(shapes)]
    fed = [_buffers(case) if kv_buffer else case for case in inputs]
    hidden = text_config(model.config).hidden_size
    cases = [Case({name: numpy_of(t) for name, t in zip(names, case, strict=True)}, (b, s, hidden),
                  f"past {p}, {s} new tokens") for case, (b, s, p) in zip(fed, shapes, strict=True)]
    wrapper = CausalLMWithCache(model, layout, attention_mask=mask)

    def eager(index: int, state: torch.Tensor, n: int, weights_of: int | None = None) -> list[torch.Tensor]:
        own = index if weights_of is None else weights_of  # whose weights and past
        case = inputs[n] if own == index else _past_moved(inputs[n], layout, own, index, mask)
        with alone(layers, index, state) as seen, _weights_of(layers, index, own):
            output = run_stopped(lambda: wrapper(*case), seen, index)
        from transformers.cache_utils import Cache

        cache = next((v for v in (*seen["args"], *seen["kwargs"].values()) if isinstance(v, Cache)), None)
        if cache is None:
            raise LayerMismatch(f"decoder layer {index} was handed no cache")
        presents = [_slot_tensor(cache.layers[index], slot.name) for slot in layout.layers[index].slots]
        if kv_buffer:  # the file's presents are the buffers, filled up to past+seq
            presents = [_filled(buffer, present) for buffer, present in
                        zip(_own(fed[n], layout, own, mask), presents, strict=True)]
        return [output if isinstance(output, torch.Tensor) else output[0], *presents]

    def outputs(index: int) -> list[str]:
        return [f"present.{index}.{slot.name}" for slot in layout.layers[index].slots]

    session = None
    if kv_buffer:  # its custom nodes renamed to ai.onnx first, as the export does
        from rope_export.hf.kv_buffer import to_standard_ops
        from rope_export.hf.layer_proof import ort_session, reference_session

        def session(proto):
            run = reference_session if next(model.parameters()).dtype == torch.bfloat16 else ort_session
            return run(proto, rename=to_standard_ops)
    with model_state_kept(model):
        return prove_layers(program_model, stamped, kinds, layers=layers, cases=cases, eager=eager,
                            first=FIRST_CASES, later=LATER_CASES, output_names=outputs, session=session, seed=seed,
                            progress=progress)


def _buffers(case: tuple) -> tuple:
    """``case`` (ids, positions, mask, *pasts) with each past a KV buffer (``kv_buffer.example_buffers``)."""
    from rope_export.hf.kv_buffer import example_buffers

    return example_buffers(None, None, case)


def _own(case: tuple, layout, index: int, mask: bool) -> list[torch.Tensor]:
    """Decoder layer ``index``'s past tensors (or buffers) in ``case`` (``CausalLMWithCache``'s inputs)."""
    first = 2 + int(mask) + sum(len(io.slots) for io in layout.layers[:index])
    return list(case[first:first + len(layout.layers[index].slots)])


def _past_moved(case: tuple, layout, source: int, target: int, mask: bool) -> tuple:
    """``case`` with layer ``target``'s past replaced by layer ``source``'s."""
    first = 2 + int(mask) + sum(len(io.slots) for io in layout.layers[:target])
    moved = list(case)
    moved[first:first + len(layout.layers[target].slots)] = _own(case, layout, source, mask)
    return tuple(moved)


@contextlib.contextmanager
def _weights_of(layers: torch.nn.ModuleList, index: int, source: int) -> Iterator[None]:
    """Layer ``index``'s module computes with layer ``source``'s parameters and buffers for the block."""
    if source == index:
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module

    state = dict((*layers[source].named_parameters(), *layers[source].named_buffers()))
    with _reparametrize_module(layers[index], state):
        yield


def _filled(buffer: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    out = buffer.clone()
    out[:, :, : present.shape[2]] = present
    return out


def traced_per_kind(model, fam, functions, census, layout, names: tuple[list[str], list[str]],
                    example: tuple[int, int, int], settings: TraceSettings, notes: list[str]):
    """(program, hook, what ran): the model cut to its leading decoder layers (each kind at least once past
    layer 0), traced, fused, stamped per layer (``names``: the whole file's input and output names); the rotary
    nodes per layer must equal transformers' rotations per layer, and every stamped layer computes what its own
    does. NotStampable says why not."""
    import warnings

    from rope_export.detect import compare_with_file

    input_names, output_names = names
    seed, fallback, say = settings.seed, settings.fallback, settings.say
    attention_mask, kv_buffer = settings.attention_mask, settings.kv_buffer
    kinds = layer_kinds(model, layout)
    n, traced = len(kinds), traced_count(kinds)
    batch, seq, past = example
    hook_ctx = rotary_hooked(model, family=fam, functions=functions) if functions else contextlib.nullcontext()
    say(f"exporting {type(model).__name__} cut to {traced} of its {n} decoder layers with torch.export "
        f"({len(set(kinds))} kind(s) of layer)")
    try:
        with model_state_kept(model), reduced(model, traced) as layers_name, hook_ctx as hook, \
                weights_kept_apart(layers_name), buffer_attention(model, kv_buffer):
            small = cache_layout(model)
            inputs = hf_example_inputs(model, batch=batch, seq=seq, past=past, seed=seed,
                                       position_rank=fam.position_rank, layout=small,
                                       attention_mask=attention_mask or kv_buffer)
            module, inputs, shapes, names_in, names_out, _ = traceable(model, None, inputs, small, fam.position_rank,
                                                                       seed, attention_mask, kv_buffer)
            program = trace_onnx(module, inputs, shapes, names_in, names_out, settings.opset, settings.verbose, say,
                                 extra=buffer_translations(kv_buffer))
            prefix = next(name for name, m in module.named_modules() if m is model) + "."
    except Exception as exc:  # noqa: BLE001 - whatever fails on two layers is left to the full trace to report
        raise NotStampable(f"the {traced}-layer trace failed ({type(exc).__name__})") from exc
    want = census.by_layer(census.plain)
    if fallback != "plain" and (hook is None or len(rotary_nodes(program.model)) <
                                sum(c for layer, c in want.items() if layer is None or layer < traced)):
        fuse_unreached(program, notes, hooked=hook is not None)
    precision.state_norm_precision(program.model)  # before stamping, which copies them (exporting.precision)
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
