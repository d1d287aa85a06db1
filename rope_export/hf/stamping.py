"""Trace once per kind of decoder layer: trace two layers, stamp the second one per real layer.

Tracing, decomposing and optimizing scale with the number of layers although the layers of a
dense model are one graph with other weights. ``export_hf(trace="per-kind")`` therefore exports the
model cut to its first two decoder layers (``reduced``), then ``stamp`` copies the second traced
layer's nodes once per further layer, each copy with that layer's weights (the torch tensors, or
the same strided view onnxscript folded a Transpose into) and cache inputs/outputs. Two layers,
not one: what the second reads from the first (the hidden state, and nothing else) is what each
copy reads from the copy before it; what both read (cos/sin, masks, shape constants) is shared.

Only what this module can check is stamped; anything else raises ``NotStampable`` with the
reason, and the caller falls back to the full trace and says so:
* one kind of layer: same classes, parameter shapes and dtypes, plain attributes (``layer_idx``
  aside) and ``layer_types`` entry for every layer; the cache one key/value pair per layer;
* the second layer's own computation (the nodes that read its weights, its cache inputs or the
  hidden state) reads exactly one value of the first layer's and hands exactly one value on; it
  reads every one of its parameters as such (or as a view), and besides them only small constants
  (shapes, scalars) and values computed outside it (cos/sin, masks), which the copies share;
* the stamped graph's rotary nodes per layer equal the rotations transformers performs per layer
  (checked by the caller).
Not detectable here: code that branches on ``layer_idx`` inside ``forward`` (not through an
attribute or ``layer_types``) past the second layer. Hence the opt-in; the quick zoo's tests
compare every stamped type with its full trace. Models with several kinds of layers
(sliding/full, MoE/dense, NoPE, hybrids) take the full trace: per-kind grouping is not built yet.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
import torch

from rope_export.hf.families import text_config

SCOPES = "pkg.torch.onnx.name_scopes"
NAMESPACE = "namespace"
MIN_LAYERS = 3  # with two or fewer layers the full trace is as short
SHARED_LIMIT = 4096  # bytes: a constant a layer shares with the others is a shape or a scalar, not a folded weight


class NotStampable(Exception):
    """Why the per-kind trace cannot be used for this model (the full trace is taken)."""


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


def _plain_attributes(module: torch.nn.Module) -> dict:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "layer_idx"
            and isinstance(v, (bool, int, float, str, tuple, type(None)))}


def check_one_kind(model, layout) -> None:
    """Raise NotStampable unless every decoder layer is the same kind with a key/value cache of its own."""
    _, _, layers, _ = decoder_layers(model)
    if len(layers) < MIN_LAYERS:
        raise NotStampable(f"{len(layers)} decoder layers: the full trace is as short")
    types = getattr(text_config(model.config), "layer_types", None) or []
    if len(set(types)) > 1:
        raise NotStampable(f"layers of several kinds ({', '.join(sorted(set(types)))}): one kind only so far")
    first = layers[0]
    shapes = [(n, p.shape, p.dtype) for n, p in first.named_parameters()]
    modules = [(n, type(m), _plain_attributes(m)) for n, m in first.named_modules()]
    for index, layer in enumerate(layers):
        if [(n, p.shape, p.dtype) for n, p in layer.named_parameters()] != shapes:
            raise NotStampable(f"decoder layer {index} has other parameters than layer 0")
        for (name, kind, attributes), (_, m) in zip(modules, layer.named_modules(), strict=True):
            if type(m) is not kind or _plain_attributes(m) != attributes:
                differ = sorted(k for k in {**attributes, **_plain_attributes(m)}
                                if attributes.get(k) != _plain_attributes(m).get(k))
                raise NotStampable(f"decoder layer {index} differs from layer 0 in {name or 'the layer'}"
                                   f"{' (' + ', '.join(differ) + ')' if differ else ''}")
    if [io.index for io in layout.layers] != list(range(len(layers))) or \
            any(io.names() != ["key", "value"] for io in layout.layers):
        raise NotStampable("the cache is not one key/value pair per decoder layer")


@contextlib.contextmanager
def reduced(model, keep: int = 2) -> Iterator[str]:
    """The model cut to its first ``keep`` decoder layers (config too); yields the layers' qualified name."""
    holder, attribute, layers, name = decoder_layers(model)
    config = text_config(model.config)
    saved_types = getattr(config, "layer_types", None)
    saved_n = config.num_hidden_layers
    setattr(holder, attribute, torch.nn.ModuleList(list(layers)[:keep]))
    config.num_hidden_layers = keep
    if saved_types is not None:
        config.layer_types = list(saved_types)[:keep]
    try:
        yield name
    finally:
        setattr(holder, attribute, layers)
        config.num_hidden_layers = saved_n
        if saved_types is not None:
            config.layer_types = saved_types


@contextlib.contextmanager
def weights_kept_apart() -> Iterator[None]:
    """onnxscript's optimizer merges equal small initializers (``DeduplicateInitializersPass``, up to 1024
    elements): two layers' norm weights of ones would become one tensor, and a copy could not tell whose
    weight it reads. Off while the two layers are traced; where it cannot be turned off, ``stamp``
    refuses a layer that does not read each of its own parameters."""
    try:
        from onnx_ir.passes.common.initializer_deduplication import DeduplicateInitializersPass
    except ImportError:
        yield
        return
    init = DeduplicateInitializersPass.__init__
    saved = init.__defaults__
    if saved != (1024,):  # another onnx_ir: leave it alone
        yield
        return
    init.__defaults__ = (0,)  # size_limit 0: every initializer is past the limit, none is merged
    try:
        yield
    finally:
        init.__defaults__ = saved


# -- stamping the traced graph ------------------------------------------------------------------

def _layer_of(node: ir.Node, scope: re.Pattern) -> int | None:
    found = scope.search(node.metadata_props.get(SCOPES, ""))
    return int(found.group(1)) if found else None


def _refuse_subgraphs(node: ir.Node) -> None:
    if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
        raise NotStampable(f"{node.name} holds a subgraph")


class _Weights:
    """Layer L's counterpart of a second-layer initializer: the parameter itself, or the same view of it."""

    def __init__(self, graph: ir.Graph, model, onnx_prefix: str, layers_name: str):
        from torch.onnx._internal.exporter._core import TorchTensor

        self.TorchTensor = TorchTensor
        self.graph, self.onnx_prefix, self.layers_name = graph, onnx_prefix, layers_name
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.by_pointer = {layer: {p.data_ptr(): n[len(f"{layers_name}.{layer}."):] for n, p in self.params.items()
                                   if n.startswith(f"{layers_name}.{layer}.")} for layer in (0, 1)}
        self.made: dict[tuple[int, str], ir.Value] = {}

    def names(self, layer: int) -> list[str]:
        head = f"{self.layers_name}.{layer}."
        return [n[len(head):] for n in self.params if n.startswith(head)]

    def rest_of(self, value: ir.Value, layer: int) -> str | None:
        """The parameter name after "layers.<layer>." that ``value`` holds or views; None if none."""
        head = f"{self.onnx_prefix}{self.layers_name}.{layer}."
        if value.name.startswith(head) and f"{self.layers_name}.{layer}.{value.name[len(head):]}" in self.params:
            return value.name[len(head):]
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, np.ndarray):
            rest = self.by_pointer[layer].get(raw.__array_interface__["data"][0])
            param = self.params.get(f"{self.layers_name}.{layer}.{rest}")
            if rest is not None and param is not None and param.is_contiguous() and \
                    raw.itemsize == param.element_size():
                return rest
        return None

    def value(self, template: ir.Value, layer: int, rest: str) -> ir.Value:
        key = (layer, template.name)
        if key in self.made:
            return self.made[key]
        param = self.params.get(f"{self.layers_name}.{layer}.{rest}")
        if param is None or not param.is_contiguous():
            raise NotStampable(f"layer {layer} has no contiguous parameter {rest}")
        raw = getattr(template.const_value, "raw", None)
        if isinstance(raw, np.ndarray):  # the view onnxscript folded a Transpose into, taken of layer L's weight
            array = param.detach()
            array = (array.view(torch.uint16) if array.dtype == torch.bfloat16 else array).numpy().view(raw.dtype)
            view = np.lib.stride_tricks.as_strided(array, shape=raw.shape, strides=raw.strides, writeable=False)
            name = f"{template.name}__layer{layer}"
            tensor = ir.Tensor(view, dtype=template.const_value.dtype, name=name)
        else:
            name = f"{self.onnx_prefix}{self.layers_name}.{layer}.{rest}"
            tensor = self.TorchTensor(param, name=name)
        value = ir.Value(name=name, shape=template.shape, type=template.type, const_value=tensor)
        self.graph.register_initializer(value)
        self.made[key] = value
        return value


def _depends(nodes: list[ir.Node], seeds: set[ir.Value]) -> list[ir.Node]:
    """The nodes of ``nodes`` (in graph order) that read a seed, directly or through each other."""
    reached, chain = set(seeds), []
    for node in nodes:
        if any(v is not None and v in reached for v in node.inputs):
            chain.append(node)
            reached.update(node.outputs)
    return chain


def _params_of(layer: int, nodes: list[ir.Node], weights: _Weights) -> set[ir.Value]:
    return {v for node in nodes for v in node.inputs
            if v is not None and v.is_initializer() and weights.rest_of(v, layer) is not None}


def stamp(program_model: ir.Model, model, *, layers_name: str, onnx_prefix: str, n_layers: int,
          input_names: list[str], output_names: list[str]) -> int:
    """Expand the traced two-layer graph to ``n_layers`` in place (see the module doc); returns the nodes
    added. NotStampable when the graph is not what this module can prove (the caller drops the graph)."""
    graph = program_model.graph
    prefix = f"{onnx_prefix}{layers_name}"
    scope = re.compile(re.escape(prefix) + r"\.(\d+)(?!\d)")
    nodes = list(graph)
    layer_of = {node: _layer_of(node, scope) for node in nodes}
    first = [n for n in nodes if layer_of[n] == 0]
    second = [n for n in nodes if layer_of[n] == 1]
    if not first or not second:
        raise NotStampable("the traced graph's nodes carry no decoder-layer scopes")
    start, end = nodes.index(second[0]), nodes.index(second[-1])
    if any(layer_of[n] != 1 for n in nodes[start:end + 1]) or any(layer_of[n] == 0 for n in nodes[start:]):
        raise NotStampable("other nodes lie between the second layer's nodes")
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    weights = _Weights(graph, model, onnx_prefix, layers_name)
    caches = {layer: {v for name, v in inputs.items() if re.fullmatch(rf"past_key_values\.{layer}\.\w+", name)}
              for layer in (0, 1)}
    # the first layer's own computation: what reads its weights or cache (shared context computed in its scope aside)
    first_chain = set(_depends(first, _params_of(0, first, weights) | caches[0]))
    handoff = {v for node in second for v in node.inputs if v is not None and v.producer() in first_chain}
    if len(handoff) != 1:
        raise NotStampable(f"the second layer reads {len(handoff)} values of the first (one hidden state expected)")
    template = _depends(second, handoff | caches[1] | _params_of(1, second, weights))
    in_template = set(template)
    position = {node: i for i, node in enumerate(template)}
    for node in template:
        _refuse_subgraphs(node)
    # a weight folded into a constant that is no view of it would be shared by every copy: refused
    read = {weights.rest_of(v, 1) for v in _params_of(1, template, weights)}
    unread = sorted(set(weights.names(1)) - read)
    if unread:
        raise NotStampable(f"the traced layer does not read its parameter {unread[0]} as such (folded into a constant)")
    large = [v.name for node in template for v in node.inputs if v is not None and v.is_initializer()
             and weights.rest_of(v, 1) is None and v.const_value is not None and v.const_value.nbytes > SHARED_LIMIT]
    if large:
        raise NotStampable(f"the traced layer reads a large constant {large[0]} that is none of its weights")
    leaving = {v for node in template for v in node.outputs
               if not (v.name in outputs and re.fullmatch(r"present\.1\.\w+", v.name))
               and (v.is_graph_output() or any(use.node not in in_template for use in v.uses()))}
    if len(leaving) != 1 or next(iter(leaving)).is_graph_output():
        raise NotStampable(f"the second layer hands on {len(leaving)} values (one hidden state expected)")
    (hidden_in,), (hidden_out,) = handoff, leaving
    missing = [v.name for node in template for v in node.inputs if v is not None and v in caches[1] and
               v.name.replace(".1.", ".0.", 1) not in inputs]
    if missing:
        raise NotStampable(f"the first layer has no cache input like {missing[0]}")

    previous = hidden_out
    added: list[ir.Node] = []
    new_inputs: dict[str, ir.Value] = {}
    for layer in range(2, n_layers):
        made: dict[ir.Value, ir.Value] = {}
        for node in template:
            args = []
            for v in node.inputs:
                if v is None:
                    args.append(None)
                elif v in made:
                    args.append(made[v])
                elif v is hidden_in:
                    args.append(previous)
                elif v in caches[1]:
                    name = v.name.replace(".1.", f".{layer}.", 1)
                    if name not in new_inputs:
                        new_inputs[name] = ir.Value(name=name, shape=v.shape, type=v.type)
                    args.append(new_inputs[name])
                elif v.is_initializer() and weights.rest_of(v, 1) is not None:
                    args.append(weights.value(v, layer, weights.rest_of(v, 1)))
                elif v.producer() is not None and v.producer() in position:
                    raise NotStampable(f"{node.name} reads a value of the layer before it is made")
                else:  # computed outside the layer's own chain (cos/sin, masks, shapes, constants): shared
                    args.append(v)
            clone = ir.Node(node.domain, node.op_type, args, attributes=list(node.attributes.values()),
                            overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                            name=f"{node.name}__layer{layer}")
            for key, text in node.metadata_props.items():
                clone.metadata_props[key] = scope.sub(f"{prefix}.{layer}", text) if key in (SCOPES, NAMESPACE) else text
            for old, new in zip(node.outputs, clone.outputs, strict=True):
                new.shape, new.type = old.shape, old.type
                cache = re.fullmatch(r"present\.1\.(\w+)", old.name or "")
                new.name = f"present.{layer}.{cache.group(1)}" if cache and old.name in outputs else \
                    f"{old.name}__layer{layer}"
                made[old] = new
            added.append(clone)
        previous = made[hidden_out]
    present = {**outputs, **{v.name: v for node in added for v in node.outputs if v.name in output_names}}
    every_input = {**inputs, **new_inputs}
    missing = [n for n in input_names if n not in every_input] + [n for n in output_names if n not in present]
    if missing:
        raise NotStampable(f"the stamped graph would lack {', '.join(missing[:3])}")
    graph.insert_after(second[-1], added)
    copies = set(added)
    for use in list(hidden_out.uses()):  # the nodes after the layers read the last copy's hidden state
        if use.node not in in_template and use.node not in copies:
            use.node.replace_input_with(use.idx, previous)
    graph.inputs.clear()
    graph.inputs.extend(every_input[n] for n in input_names)
    graph.outputs.clear()
    graph.outputs.extend(present[n] for n in output_names)
    return len(added)
