"""Trace once per kind of layer: trace the leading layers of a stack, stamp one traced layer per further layer.

Tracing, decomposing and optimizing scale with the number of layers although layers of one kind
are one graph with other weights. A front end with a stack of layers (a ``ModuleList``: a decoder's
``layers``, an encoder's blocks) groups them into kinds (``group_layers``: same classes, plain
attributes with ``layer_idx`` aside, parameter shapes and dtypes, equal buffers, and whatever the
front end adds: transformers' ``layer_types`` entry and cache slots), traces the model cut to its
leading layers (``cut_layers``) until every kind has appeared at a position past layer 0
(``traced_count``: two layers for a dense stack) with its parameters kept apart
(``weights_kept_apart``), then ``stamp`` copies, for each further layer, the nodes of the first traced
layer of its kind, with that layer's weights (the torch tensors, or the same strided view onnxscript
folded a Transpose into) and its per-layer graph inputs and outputs (``LayerNames``: the caches).
Past layer 0, because a copy reads from the copy before it what that traced layer read from the
layer before it: the hidden state, and nothing else; what the layers read from outside (cos/sin,
masks, shape constants) is shared.

Only what this module can check is stamped; anything else raises ``NotStampable`` with the
reason, and the caller falls back to the full trace and says so:
* each template (a traced layer's own computation: the nodes that read its weights, its per-layer
  inputs or the hidden state) reads exactly one value of the layer before and hands exactly one
  on, the one the next traced layer reads; it reads every one of its parameters as such (or as a
  view), and besides them only small constants (shapes, scalars) and values computed outside it;
* the layers of one kind hold equal buffers (a copy shares its template's constants);
* no module of a layer reads its layer index in ``forward`` but to hand it to a call (the cache
  update's ``self.layer_idx``): a branch or a value per layer would differ between a layer and its
  copy (``layer_index_use`` reads each class's source).
What structure cannot see (a layer index reached another way: a global table, a closure, a hook)
numbers can: ``rope_export.hf.layer_proof.prove_layers`` runs every stamped layer against the
front end's own eager layer before the file is written.

A front end uses it so (``rope_export.hf.stamping`` for transformers' decoders)::

    kinds = group_layers(layers)                       # NotStampable: trace in full
    traced = traced_count(kinds)
    with cut_layers(holder, "layers", traced), weights_kept_apart("model.layers"):
        program = torch.onnx.export(...)                # the front end's own trace of the cut model
    stamped = stamp(program.model, model, layers_name="model.layers", onnx_prefix=..., kinds=kinds,
                    input_names=..., output_names=...)  # the whole model's I/O names
    prove_layers(program.model, stamped, kinds, layers=layers, eager=..., cases=...)
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

SCOPES = "pkg.torch.onnx.name_scopes"
NAMESPACE = "namespace"
MIN_LAYERS = 3  # with two or fewer layers the full trace is as short
SHARED_LIMIT = 4096  # bytes: a constant a layer shares with the others is a shape or a scalar, not a folded weight


class NotStampable(Exception):
    """Why the per-kind trace cannot be used for this model (the full trace is taken)."""


@dataclass(frozen=True)
class LayerNames:
    """How a layer's own graph inputs and outputs are named (``{layer}``: its index): a decoder's caches."""

    inputs: str = "past_key_values.{layer}."
    outputs: str = "present.{layer}."

    def input_of(self, name: str, layer: int) -> bool:
        return name.startswith(self.inputs.format(layer=layer)) and bool(self.inputs)

    def output_of(self, name: str, layer: int) -> bool:
        return name.startswith(self.outputs.format(layer=layer)) and bool(self.outputs)

    def moved(self, name: str, source: int, layer: int) -> str:
        """``name`` of layer ``source``'s as layer ``layer``'s."""
        for pattern in (self.inputs, self.outputs):
            head = pattern.format(layer=source)
            if pattern and name.startswith(head):
                return pattern.format(layer=layer) + name[len(head):]
        return name


@dataclass
class StampedLayer:
    """Layer ``index`` as ``stamp`` made it: its nodes, the hidden state it reads and hands on, its own outputs."""

    index: int
    nodes: list[ir.Node]
    hidden_in: ir.Value
    hidden_out: ir.Value
    outputs: list[ir.Value]  # its graph outputs (a decoder's presents), in the graph's output order


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, (bool, int, float, str, type(None)))


def _plain_attributes(module: torch.nn.Module) -> dict:
    """Settings of a module (numbers, strings, and lists, tuples, dicts of them), layer_idx aside."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "layer_idx" and _plain(v)}


def _signature(layer: torch.nn.Module, extra) -> tuple:
    """What makes two layers one kind: classes, plain attributes, parameters, and what the front end adds."""
    modules = tuple((n, type(m).__qualname__, tuple(sorted(_plain_attributes(m).items(), key=str)))
                    for n, m in layer.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
    return modules, params, extra


@functools.cache
def layer_index_use(cls: type) -> str | None:
    """How ``cls.forward`` uses the layer index other than as a call's argument (the cache update's
    ``self.layer_idx``): a branch or a value per layer, which a stamped copy of another layer would not
    have; None if it does not."""
    forward = getattr(cls, "forward", None)
    if forward is None or forward is torch.nn.Module.forward:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return f"the source of {cls.__qualname__}.forward cannot be read"
    arguments = {id(a) for node in ast.walk(tree) if isinstance(node, ast.Call)
                 for a in (*node.args, *(k.value for k in node.keywords))}
    for node in ast.walk(tree):
        named = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if named == "layer_idx" and id(node) not in arguments:
            return f"{cls.__qualname__}.forward reads its layer index ({ast.unparse(node)}) to compute or branch"
    return None


def group_layers(layers: torch.nn.ModuleList, extras: list | None = None) -> list[int]:
    """Each layer's kind (the index of the first layer like it); ``extras[i]``: what the front end adds to
    layer i's signature. NotStampable when the layers cannot be grouped or nothing would be gained."""
    if len(layers) < MIN_LAYERS:
        raise NotStampable(f"{len(layers)} layers: the full trace is as short")
    for cls in dict.fromkeys(type(m) for m in layers.modules() if m is not layers):
        why = layer_index_use(cls)
        if why:
            raise NotStampable(why)
    extras = extras or [None] * len(layers)
    signatures = [_signature(layer, extras[i]) for i, layer in enumerate(layers)]
    kinds = [signatures.index(sig) for sig in signatures]
    _same_constants(layers, kinds)
    if traced_count(kinds) >= len(layers):
        raise NotStampable(f"{len(set(kinds))} kinds of layers: every layer would be traced anyway")
    return kinds


def _constants(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer's buffers and the tensors its modules hold as plain attributes (traced as constants too)."""
    found = dict(layer.named_buffers())
    for prefix, module in layer.named_modules():
        found.update({f"{prefix}.{k}".lstrip("."): v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
    return found


def _same_constants(layers: torch.nn.ModuleList, kinds: list[int]) -> None:
    """Buffers and tensor attributes are no parameters: a copy reads its template's (a constant up to
    ``SHARED_LIMIT`` is shared), so the layers of one kind must hold equal ones; NotStampable names a per-layer
    constant that differs."""
    for i, layer in enumerate(layers):
        first = _constants(layers[kinds[i]])
        for name, buffer in _constants(layer).items():
            other = first.get(name)
            if other is None or other.shape != buffer.shape or other.dtype != buffer.dtype or \
                    buffer.device.type == "meta" or not torch.equal(other, buffer):
                raise NotStampable(f"layer {i}'s buffer {name} differs from layer {kinds[i]}'s (a constant "
                                   "per layer, which a stamped copy would not have)")


def traced_count(kinds: list[int]) -> int:
    """How many leading layers to trace: each kind of a layer past 0 must appear at a position >= 1 (its
    template reads the hidden state a traced layer before it hands on); a kind of layer 0 alone (DeepSeek's
    dense first layer) needs no template."""
    return 1 + max(kinds.index(k, 1) for k in set(kinds[1:]))


def templates_of(kinds: list[int]) -> dict[int, int]:
    """{kind of a layer past the traced ones: the traced layer (past 0) each such layer is stamped from}."""
    traced = traced_count(kinds)
    return {k: next(j for j in range(1, traced) if kinds[j] == k) for k in set(kinds[traced:])}


@contextlib.contextmanager
def cut_layers(holder: torch.nn.Module, attribute: str, keep: int) -> Iterator[torch.nn.ModuleList]:
    """``holder.<attribute>`` (a ModuleList) cut to its first ``keep`` layers for the block; yields the whole list."""
    layers = getattr(holder, attribute)
    setattr(holder, attribute, torch.nn.ModuleList(list(layers)[:keep]))
    try:
        yield layers
    finally:
        setattr(holder, attribute, layers)


@contextlib.contextmanager
def weights_kept_apart(layers_name: str) -> Iterator[None]:
    """Each layer's parameters stay initializers of their own while the leading layers are traced, so that a
    copy can read another layer's in their place; else ``stamp`` refuses the layer that does not read each of its
    parameters. Two onnxscript passes would merge or replace them:

    * ``DeduplicateInitializersPass`` merges equal small initializers (up to 1024 elements): two layers' norm
      weights of ones would become one tensor; its size limit is set to 0;
    * constant folding (``optimize_ir``, which torch.onnx runs) folds a node whose inputs are all constants
      into a new initializer: Gemma's ``1 + weight`` of each norm becomes a tensor no other layer's weight
      gives; its ``should_fold`` now keeps every node but a Transpose that reads a layer's parameter (a folded
      Transpose is a view of the parameter, which ``stamp`` takes of each layer's own; the runtime folds the
      rest when it loads the file).
    Either is left alone where onnx_ir or onnxscript differs from the versions this was written against."""
    layer_parameter = re.compile(rf"(?:^|\.){re.escape(layers_name)}\.\d+\.")

    def should_fold(node: ir.Node) -> bool | None:
        if node.op_type != "Transpose" and any(v is not None and v.is_initializer() and layer_parameter.search(v.name)
                                               for v in node.inputs):
            return False
        return None

    with contextlib.ExitStack() as stack:
        try:
            from onnx_ir.passes.common.initializer_deduplication import DeduplicateInitializersPass
        except ImportError:
            pass
        else:
            if DeduplicateInitializersPass.__init__.__defaults__ == (1024,):
                stack.enter_context(_default_replaced(DeduplicateInitializersPass.__init__, "__defaults__", (0,)))
        try:
            from onnxscript.optimizer._optimizer import optimize_ir  # torch.onnx's optimize calls it, no should_fold
        except ImportError:
            pass
        else:
            defaults = optimize_ir.__kwdefaults__ or {}
            if "should_fold" in defaults:
                stack.enter_context(_default_replaced(optimize_ir, "__kwdefaults__",
                                                      {**defaults, "should_fold": should_fold}))
        yield


@contextlib.contextmanager
def _default_replaced(function, attribute: str, value) -> Iterator[None]:
    saved = getattr(function, attribute)
    setattr(function, attribute, value)
    try:
        yield
    finally:
        setattr(function, attribute, saved)


# -- stamping the traced graph ------------------------------------------------------------------

def _layer_of(node: ir.Node, scope: re.Pattern) -> int | None:
    found = scope.search(node.metadata_props.get(SCOPES, ""))
    return int(found.group(1)) if found else None


def _adopt_unscoped(nodes: list[ir.Node], layer_of: dict[ir.Node, int | None]) -> None:
    """onnxscript's rewrites (two Slices into a Split, ...) make nodes without the name scope of the layer they
    compute in (MoE routers, MLA attention). Such a node joins layer j when every value it reads that a node
    makes is made by layer j's nodes and every node that reads its outputs is layer j's."""
    for node in nodes:
        if layer_of[node] is not None or any(v.is_graph_output() for v in node.outputs):
            continue
        makers = {layer_of.get(v.producer()) for v in node.inputs if v is not None and v.producer() is not None}
        readers = {layer_of.get(use.node) for v in node.outputs for use in v.uses()}
        if len(makers) == 1 and makers == readers and None not in makers:
            layer_of[node] = makers.pop()


def _refuse_subgraphs(node: ir.Node) -> None:
    if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
        raise NotStampable(f"{node.name} holds a subgraph")


class _Weights:
    """Layer L's counterpart of a second-layer initializer: the parameter itself, or the same view of it."""

    def __init__(self, graph: ir.Graph, model, onnx_prefix: str, layers_name: str, traced: int):
        from torch.onnx._internal.exporter._core import TorchTensor

        self.TorchTensor = TorchTensor
        self.graph, self.onnx_prefix, self.layers_name = graph, onnx_prefix, layers_name
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.by_pointer = {layer: {p.data_ptr(): n[len(f"{layers_name}.{layer}."):] for n, p in self.params.items()
                                   if n.startswith(f"{layers_name}.{layer}.")} for layer in range(traced)}
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


def _own_inputs(inputs: dict, layer: int, names: LayerNames) -> set[ir.Value]:
    return {v for name, v in inputs.items() if names.input_of(name, layer)}


def _template(j: int, nodes: list[ir.Node], chain_before: set[ir.Node], inputs: dict, weights: _Weights,
              names: LayerNames):
    """(the nodes of traced layer j's own computation, the hidden state it reads, the one it hands on)."""
    handoff = {v for node in nodes for v in node.inputs if v is not None and v.producer() in chain_before}
    if len(handoff) != 1:
        raise NotStampable(f"layer {j} reads {len(handoff)} values of the layer before (one hidden state expected)")
    template = _depends(nodes, handoff | _own_inputs(inputs, j, names) | _params_of(j, nodes, weights))
    own = set(template)
    for node in template:
        _refuse_subgraphs(node)
    read = {weights.rest_of(v, j) for v in _params_of(j, template, weights)}
    unread = sorted(set(weights.names(j)) - read)
    if unread:  # a weight folded into a constant that is no view of it would be shared by every copy
        raise NotStampable(f"layer {j} does not read its parameter {unread[0]} as such (folded into a constant)")
    large = [v.name for node in template for v in node.inputs if v is not None and v.is_initializer()
             and weights.rest_of(v, j) is None and v.const_value is not None and v.const_value.nbytes > SHARED_LIMIT]
    if large:
        raise NotStampable(f"layer {j} reads a large constant {large[0]} that is none of its weights")
    leaving = {v for node in template for v in node.outputs
               if not (v.is_graph_output() and names.output_of(v.name or "", j))
               and (v.is_graph_output() or any(use.node not in own for use in v.uses()))}
    if len(leaving) != 1 or next(iter(leaving)).is_graph_output():
        raise NotStampable(f"layer {j} hands on {len(leaving)} values (one hidden state expected)")
    return template, next(iter(handoff)), next(iter(leaving))


def _scoped(graph: ir.Graph, scope: re.Pattern, traced: int) -> tuple[list[ir.Node], list[list[ir.Node]]]:
    """(the graph's nodes, each traced layer's nodes); NotStampable unless every traced layer has nodes and the
    last one's lie together."""
    nodes = list(graph)
    layer_of = {node: _layer_of(node, scope) for node in nodes}
    _adopt_unscoped(nodes, layer_of)
    by_layer = [[n for n in nodes if layer_of[n] == j] for j in range(traced)]
    if not all(by_layer) or any(layer is not None and layer >= traced for layer in layer_of.values()):
        raise NotStampable("the traced graph's nodes carry no layer scopes for every traced layer")
    last = by_layer[-1]
    start, end = nodes.index(last[0]), nodes.index(last[-1])
    if any(layer_of[n] != traced - 1 for n in nodes[start:end + 1]) or \
            any(layer_of[n] is not None and layer_of[n] < traced - 1 for n in nodes[start:]):
        raise NotStampable("other nodes lie between the last traced layer's nodes")
    return nodes, by_layer


class _Copier:
    """Copies of a traced layer's nodes as layer L's: its weights, its own graph inputs and outputs, its scope."""

    def __init__(self, weights: _Weights, names: LayerNames, scope: re.Pattern, prefix: str, outputs: dict):
        self.weights, self.names, self.scope, self.prefix, self.outputs = weights, names, scope, prefix, outputs
        self.new_inputs: dict[str, ir.Value] = {}

    def copy(self, layer: int, j: int, template: list[ir.Node], hidden_in: ir.Value, previous: ir.Value):
        """(layer's nodes, {template value: layer's}) of template j reading ``previous`` as its hidden state."""
        own, made, clones = set(template), {}, []
        for node in template:
            args = [self._input(v, made, hidden_in, previous, own, layer, j, node) for v in node.inputs]
            clone = ir.Node(node.domain, node.op_type, args, attributes=list(node.attributes.values()),
                            overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                            name=f"{node.name}__layer{layer}")
            for key, text in node.metadata_props.items():
                clone.metadata_props[key] = (self.scope.sub(f"{self.prefix}.{layer}", text)
                                             if key in (SCOPES, NAMESPACE) else text)
            for old, new in zip(node.outputs, clone.outputs, strict=True):
                new.shape, new.type = old.shape, old.type
                own_output = old.name in self.outputs and self.names.output_of(old.name, j)
                new.name = self.names.moved(old.name, j, layer) if own_output else f"{old.name}__layer{layer}"
                made[old] = new
            clones.append(clone)
        return clones, made

    def _input(self, v, made, hidden_in, previous, own, layer: int, j: int, node) -> ir.Value | None:
        if v is None:
            return None
        if v in made:
            return made[v]
        if v is hidden_in:
            return previous
        if v.is_graph_input() and self.names.input_of(v.name, j):
            name = self.names.moved(v.name, j, layer)
            if name not in self.new_inputs:
                self.new_inputs[name] = ir.Value(name=name, shape=v.shape, type=v.type)
            return self.new_inputs[name]
        rest = self.weights.rest_of(v, j) if v.is_initializer() else None
        if rest is not None:
            return self.weights.value(v, layer, rest)
        if v.producer() is not None and v.producer() in own:
            raise NotStampable(f"{node.name} reads a value of layer {j} before it is made")
        return v  # computed outside the layers' own chains (cos/sin, masks, shapes, constants): shared


def stamp(program_model: ir.Model, model, *, layers_name: str, onnx_prefix: str, kinds: list[int],
          input_names: list[str], output_names: list[str], names: LayerNames = LayerNames()) -> list[StampedLayer]:
    """Expand the traced leading layers to ``len(kinds)`` in place (see the module doc): layer L is a copy of
    the first traced layer (past layer 0) of its kind. ``input_names``/``output_names``: the whole model's;
    ``names``: which of them are a layer's own. Returns the layers added (their nodes, hidden states and own
    outputs: what ``layer_proof`` runs); NotStampable when the graph is not what this module can check (the
    caller drops the graph)."""
    graph = program_model.graph
    traced, n_layers = traced_count(kinds), len(kinds)
    prefix = f"{onnx_prefix}{layers_name}"
    scope = re.compile(re.escape(prefix) + r"\.(\d+)(?!\d)")
    _, by_layer = _scoped(graph, scope, traced)
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    weights = _Weights(graph, model, onnx_prefix, layers_name, traced)
    chain = set(_depends(by_layer[0], _params_of(0, by_layer[0], weights) | _own_inputs(inputs, 0, names)))
    templates = {}  # traced layer j >= 1 -> (template, hidden in, hidden out)
    for j in range(1, traced):
        templates[j] = _template(j, by_layer[j], chain, inputs, weights, names)
        chain = set(templates[j][0])
    for j in range(1, traced - 1):  # each traced layer hands on exactly what the next one reads
        if templates[j][2] is not templates[j + 1][1]:
            raise NotStampable(f"layer {j + 1} reads another value than the hidden state layer {j} hands on")
    source = templates_of(kinds)
    copier = _Copier(weights, names, scope, prefix, outputs)
    previous = hidden_out = templates[traced - 1][2]
    stamped: list[StampedLayer] = []
    for layer in range(traced, n_layers):
        template, hidden_in, out = templates[source[kinds[layer]]]
        clones, made = copier.copy(layer, source[kinds[layer]], template, hidden_in, previous)
        own = {v.name: v for node in clones for v in node.outputs if names.output_of(v.name or "", layer)}
        stamped.append(StampedLayer(layer, clones, previous, made[out], [own[n] for n in output_names if n in own]))
        previous = made[out]
    added = [node for layer in stamped for node in layer.nodes]
    present = {**outputs, **{v.name: v for node in added for v in node.outputs if v.name in output_names}}
    every_input = {**inputs, **copier.new_inputs}
    missing = [n for n in input_names if n not in every_input] + [n for n in output_names if n not in present]
    if missing:
        raise NotStampable(f"the stamped graph would lack {', '.join(missing[:3])}")
    graph.insert_after(by_layer[-1][-1], added)
    skip = set(added) | set(templates[traced - 1][0])
    for use in list(hidden_out.uses()):  # the nodes after the layers read the last copy's hidden state
        if use.node not in skip:
            use.node.replace_input_with(use.idx, previous)
    graph.inputs.clear()
    graph.inputs.extend(every_input[n] for n in input_names)
    graph.outputs.clear()
    graph.outputs.extend(present[n] for n in output_names)
    return stamped
