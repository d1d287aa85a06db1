"""Proving stamped layers by numbers: each copy in the file against the front end's own eager layer.

``rope_export.exporting.stamping`` copies a traced layer's nodes once per further layer with that
layer's weights. That is right only where a layer computes nothing but what its weights and inputs
give: a global table, a closure, a hook or a per-layer constant nobody declared would make layer L
differ from the copy. Structure cannot see those; numbers can. So, before the file is written,
``prove_layers`` runs the model's own layer L eagerly for every stamped layer (``alone``: the model's
own forward with every layer before L handing its hidden state on unchanged, L given a random hidden
state, the forward stopped after L, so L gets what the model hands it: masks by layer type,
per-layer inputs) and compares it with what the file computes for L, for each of the front end's
cases (a decoder: two cache lengths, one on each side of the traced example's), the hidden state out
and the layer's own outputs (a decoder's presents) held to the op tolerance of the dtype
(``rope_export.op.tolerances``). The first layer beyond it raises ``LayerMismatch`` naming the
layer, the output, the error and the case, and the front end traces in full.

What the file computes for L: for the first stamped layer of each kind, its own nodes run alone on
onnxruntime (``KindModel``: those nodes, the nodes outside the layers that compute what they read,
i.e. cos/sin, masks and shapes, and the layer's weights and every larger constant fed as inputs, so
the model holds no weights; onnx.reference for bfloat16), which proves the traced template's graph.
For a later layer of the kind, whose nodes ``same_structure`` finds to be the first's node by node
(reading the same shared values, and weights that lie in its own parameters), the template's module
computing with L's weights and past at the template's place (the front end's ``eager(...,
weights_of=L)``): what the copy computes, in torch. onnxruntime's CPU provider converts fp16 weights
fed as inputs on every run (0.7-0.9 s per 2048x8192 MatMul on a busy machine), so running every layer
there would cost about a minute for a 1B fp16 model.

Which cases: the first layer of a kind runs the cases ``first`` names (its graph at several cache lengths), a
later one those ``later`` names: its module against the template's, where one case whose positions lie on
both sides of the traced example's does what two did (each case of a later layer costs two eager layers;
the graph's own generality is the first layer's to prove).

Cost and memory: one layer's weights at a time (a mapped checkpoint's pages given back after each layer,
``rope_export.files.mapped``); only the first layer of a kind has its weights copied (the contiguous
arrays onnxruntime is fed: a later layer's eager run reads them where they are). torch and onnxruntime
run on one thread: a few tokens, so a layer's cost is reading its weights once, and on a busy machine
a second thread only waits (a 1B fp32 model's proof took 32 s on two threads at load 9, its 28 eager
layers' small ops 15-30 ms each, against 12.7 s on one at load 11, the same cases).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import torch

from rope_export.exporting.stamping import StampedLayer, templates_of
from rope_export.op.tolerances import TOLERANCES

INLINE_LIMIT = 4096  # bytes: a shared constant up to this is written into the layer's model, a larger one fed


class LayerMismatch(Exception):
    """A stamped layer computes something else than the model's own layer (the full trace is taken)."""


@dataclass(frozen=True)
class Case:
    """One comparison: the graph inputs by name, and the hidden state's shape ([batch, seq, hidden])."""

    feeds: dict[str, np.ndarray]
    hidden_shape: tuple[int, ...]
    label: str  # e.g. "past 1, 2 new tokens"


@dataclass(frozen=True)
class Proof:
    layers: int
    cases: int  # the first stamped layer of each kind
    worst: float  # the largest error over its bound (< 1: every layer within tolerance)
    seconds: float
    later_cases: int | None = None  # each later one (None: as many)

    def describe(self) -> str:
        later = self.cases if self.later_cases is None else self.later_cases
        where = f"in {self.cases} cases" if later == self.cases else \
            f"(the first of each kind in {self.cases} cases, the others in {later})"
        return f"each stamped layer equal to the model's own {where} (worst {self.worst:.2f} of the op tolerance)"


# -- the model's own layer L --------------------------------------------------------------------

class _Stop(Exception):
    def __init__(self, output):
        super().__init__("the layer is done")
        self.output = output


@contextlib.contextmanager
def alone(layers: torch.nn.ModuleList, index: int, hidden: torch.Tensor) -> Iterator[dict]:
    """Within the block the model's forward runs layer ``index`` alone: the layers before it hand their hidden
    state on unchanged (their own forward replaced for the call), ``index`` gets ``hidden`` (its first argument or
    ``hidden_states``) and stops the forward once done. Yields a dict that gets ``args``/``kwargs`` (what the
    layer was handed) and ``output`` (what it returned); call the model's forward inside ``run_stopped``."""
    seen: dict = {}

    def passthrough(*args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]

    def before(module, args, kwargs):
        args, kwargs = ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        seen.update(args=args, kwargs=kwargs)
        return args, kwargs

    def after(module, args, output):
        raise _Stop(output)

    saved = {i: vars(layers[i]).get("forward") for i in range(index)}
    handles = [layers[index].register_forward_pre_hook(before, with_kwargs=True),
               layers[index].register_forward_hook(after)]
    try:
        for i in range(index):
            layers[i].forward = passthrough
        yield seen
    finally:
        for handle in handles:
            handle.remove()
        for i, forward in saved.items():
            if forward is None:
                del layers[i].forward
            else:
                layers[i].forward = forward


def run_stopped(forward: Callable[[], object], seen: dict, index: int) -> object:
    """Call ``forward`` (the model's, inside ``alone``); the layer's output."""
    try:
        with torch.no_grad():
            forward()
    except _Stop as stop:
        seen["output"] = stop.output
        return stop.output
    raise LayerMismatch(f"layer {index} was not called by the model's forward")


# -- the file's layer L -------------------------------------------------------------------------

def _ancestors(graph_order: dict[ir.Node, int], seeds: list[ir.Value], stop: ir.Value) -> list[ir.Node]:
    """The nodes that compute ``seeds`` from graph inputs and initializers (not through ``stop``), in graph order."""
    found: set[ir.Node] = set()
    todo = [v for v in seeds if v is not stop]
    while todo:
        node = todo.pop().producer()
        if node is None or node in found:
            continue
        found.add(node)
        todo += [v for v in node.inputs if v is not None and v is not stop]
    return sorted(found, key=graph_order.__getitem__)


def _numpy(value: ir.Value) -> np.ndarray:
    """The initializer's array as onnxruntime takes it (contiguous: a transposed view is copied, by torch's strided
    copy: numpy's ran at about 0.2 GB/s on a 1B model's transposed fp32 weights, 1.5 s a layer)."""
    from rope_export.files.tensor_stream import contiguous

    return contiguous(value.const_value.numpy())


class KindModel:
    """The first stamped layer of a kind as a model of its own, on onnxruntime (see the module doc): the hidden
    state in, the graph inputs read, the layer's own initializers and every larger one as inputs; the hidden
    state out and the layer's own outputs as outputs. ``prepare`` is how a later layer of the kind runs on it."""

    def __init__(self, program_model: ir.Model, graph_order: dict[ir.Node, int], first: StampedLayer,
                 session: Callable[[onnx.ModelProto], object]):
        self.first = first
        own = set(first.nodes)
        outside = [v for node in first.nodes for v in node.inputs
                   if v is not None and v.producer() is not None and v.producer() not in own]
        nodes = [*_ancestors(graph_order, outside, first.hidden_in), *first.nodes]
        read = {v.name: v for node in nodes for v in node.inputs if v is not None}
        if first.hidden_in.name not in read:
            raise LayerMismatch(f"stamped layer {first.index} does not read its hidden state")
        inline, self.inputs = [], [first.hidden_in]
        for value in read.values():
            if value is first.hidden_in or not (value.is_graph_input() or value.is_initializer()):
                continue
            if value.is_graph_input() or value.const_value is None or value.const_value.nbytes > INLINE_LIMIT or \
                    all(use.node in own for use in value.uses()):  # the layer's own (its norm weights) is fed
                self.inputs.append(value)
            else:
                inline.append(ir.serde.serialize_tensor(value.const_value))
                inline[-1].name = value.name
        graph = onnx.helper.make_graph(
            [ir.serde.serialize_node(node) for node in nodes], f"layer_{first.index}",
            [ir.serde.serialize_value(v) for v in self.inputs],
            [ir.serde.serialize_value(v) for v in (first.hidden_out, *first.outputs)], inline)
        opsets = [onnx.helper.make_opsetid(d, v) for d, v in program_model.opset_imports.items()]
        self.weights: dict[str, np.ndarray] | None = None
        self.session = session(onnx.helper.make_model(graph, opset_imports=opsets,
                                                      ir_version=program_model.ir_version))

    def check(self, layer: StampedLayer, module: torch.nn.Module) -> None:
        """LayerMismatch unless ``layer``'s nodes are the first's (``same_structure``), every weight it reads lies in
        ``module``'s parameters (its module's) and it reads as its own nothing the first layer's model shares."""
        counterpart = same_structure(self.first, layer)
        _weights_within(layer, [v for v in counterpart.values() if v.is_initializer()], module)
        shared = [v.name for v in counterpart if v not in self.inputs]
        if shared:  # written into the model as the first layer's, while this layer reads its own
            raise LayerMismatch(f"stamped layer {layer.index} reads its own counterpart of {shared[0]}, a constant "
                                f"layer {self.first.index} shares")

    def run(self, given: dict[str, np.ndarray], hidden: np.ndarray) -> list[np.ndarray]:
        """The first layer's nodes on (graph inputs by name, the hidden state): its hidden state out and outputs."""
        if self.weights is None:  # copied once, for the first layer's runs
            self.weights = {v.name: _numpy(v) for v in self.inputs[1:] if v.is_initializer()}
        missing = [v.name for v in self.inputs[1:] if not v.is_initializer() and v.name not in given]
        if missing:
            raise LayerMismatch(f"stamped layer {self.first.index} reads {missing[0]}, which no input gives")
        feeds = {self.first.hidden_in.name: hidden, **self.weights,
                 **{v.name: given[v.name] for v in self.inputs[1:] if not v.is_initializer()}}
        return self.session.run(None, feeds)


def _weights_within(layer: StampedLayer, weights: list[ir.Value], module: torch.nn.Module) -> None:
    """LayerMismatch unless each of ``weights`` (the layer's own initializers: a parameter, or a view of one) lies in
    the memory of one of ``module``'s parameters: a copy reads its own layer's weights, no other layer's."""
    from rope_export.files.mapped import extent

    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in module.parameters()]
    for value in weights:
        tensor = value.const_value
        raw = tensor.raw if hasattr(tensor, "raw") else None
        if isinstance(raw, torch.Tensor):
            low, size = raw.data_ptr(), raw.numel() * raw.element_size()
        elif isinstance(raw, np.ndarray):
            low, size = extent(raw)
        else:
            raise LayerMismatch(f"stamped layer {layer.index}'s weight {value.name} is no tensor of the model")
        if not any(start <= low and low + size <= end for start, end in spans):
            raise LayerMismatch(f"stamped layer {layer.index} reads {value.name}, which is none of its own weights")


def same_structure(first: StampedLayer, layer: StampedLayer) -> dict[ir.Value, ir.Value]:
    """{a value the first layer's nodes read: ``layer``'s counterpart} for its own initializers and graph inputs;
    LayerMismatch unless ``layer``'s nodes are the first's node by node (op, attributes, and inputs: its own
    counterparts, or the very same shared value)."""
    if first is layer:
        return {}
    if len(first.nodes) != len(layer.nodes):
        raise LayerMismatch(f"stamped layer {layer.index} has {len(layer.nodes)} nodes, layer {first.index} "
                            f"{len(first.nodes)}")
    made: dict[ir.Value, ir.Value] = {first.hidden_in: layer.hidden_in}
    counterpart: dict[ir.Value, ir.Value] = {}
    for a, b in zip(first.nodes, layer.nodes, strict=True):
        if _node_form(a) != _node_form(b):
            raise LayerMismatch(f"stamped layer {layer.index}'s node {b.name} is not layer {first.index}'s {a.name}")
        for x, y in zip(a.inputs, b.inputs, strict=True):
            if x is y or (x in made and made[x] is y):
                continue
            own = x is not None and y is not None and x.producer() is None and y.producer() is None and (
                (x.is_initializer() and y.is_initializer() and x.shape == y.shape and x.dtype == y.dtype) or
                (x.is_graph_input() and y.is_graph_input()))
            if not own or x in counterpart:
                raise LayerMismatch(f"stamped layer {layer.index}'s node {b.name} reads {getattr(y, 'name', None)} "
                                    f"where layer {first.index}'s reads {getattr(x, 'name', None)}")
            counterpart[x] = y
        made.update(zip(a.outputs, b.outputs, strict=True))
    return counterpart


def _node_form(node: ir.Node) -> tuple:
    return (node.domain, node.op_type, len(node.inputs), len(node.outputs),
            {name: attr.value for name, attr in node.attributes.items()})


def ort_session(model: onnx.ModelProto, rename: Callable[[onnx.ModelProto], object] | None = None):
    """onnxruntime CPU on ``model`` with its rotary nodes lowered to ai.onnx RotaryEmbedding, one thread;
    ``rename`` first (a front end's own custom nodes to ai.onnx: a KV buffer's)."""
    import onnxruntime as ort

    from rope_export.passes import lower

    if rename is not None:
        rename(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(lower(model, "onnx").SerializeToString(), options, providers=["CPUExecutionProvider"])


# -- both, layer by layer -----------------------------------------------------------------------

def prove_layers(program_model: ir.Model, stamped: list[StampedLayer], kinds: list[int], *,
                 layers: torch.nn.ModuleList, cases: list[Case],
                 eager: Callable[..., list[torch.Tensor]],
                 first: tuple[int, ...] | None = None, later: tuple[int, ...] | None = None,
                 output_names: Callable[[int], list[str]] | None = None,
                 session: Callable[[onnx.ModelProto], object] | None = None,
                 seed: int = 0, progress: Callable[[str], None] | None = None) -> Proof:
    """Every stamped layer of ``program_model`` against the model's own (see the module doc); LayerMismatch names
    the first that differs. ``kinds``: each layer's kind (``stamping.group_layers``). ``first``/``later``: the
    indices of the cases the first stamped layer of each kind and each later one run (default: every case).
    ``eager(index, hidden, case, weights_of=None)``: the model's layer ``index`` on case ``case``'s inputs with
    ``hidden`` as its hidden state in (``alone``, ``run_stopped``), as (hidden state out, *its own outputs in the
    order of ``StampedLayer.outputs``); with ``weights_of=L``: layer ``index``'s module computing with layer L's
    parameters and buffers and L's own inputs (its past), at ``index``'s place. ``output_names(index)`` names the
    outputs for the messages; ``session(model proto)``: what runs a layer's model (default: onnxruntime,
    onnx.reference for bfloat16)."""
    say = progress or (lambda message: None)
    start = time.perf_counter()
    dtype = next(layers.parameters()).dtype
    tolerance = TOLERANCES["op"][str(dtype).removeprefix("torch.")]
    session = session or (reference_session if dtype == torch.bfloat16 else ort_session)
    graph_order = {node: i for i, node in enumerate(program_model.graph)}
    templates = templates_of(kinds)
    first = tuple(range(len(cases))) if first is None else first
    later = first if later is None else later
    say(f"comparing each of the {len(stamped)} stamped layers with the model's own, alone, in "
        f"{_how_many(len(first), len(later))}")
    worst, models = 0.0, {}
    with _threads(1):
        for layer in stamped:
            kind = kinds[layer.index]
            is_first = kind not in models
            if is_first:
                models[kind] = KindModel(program_model, graph_order, layer, session)
            model = models[kind]
            model.check(layer, layers[layer.index])
            names = ["hidden state", *(output_names(layer.index) if output_names else
                                       [v.name for v in layer.outputs])]
            for n in first if is_first else later:
                generator = torch.Generator().manual_seed(seed + 1000 * layer.index + n)
                hidden = torch.randn(cases[n].hidden_shape, generator=generator).to(dtype)
                expected = [numpy_of(t) for t in eager(layer.index, hidden, n)]
                actual = model.run(cases[n].feeds, numpy_of(hidden)) if is_first else \
                    [numpy_of(t) for t in eager(templates[kind], hidden, n, weights_of=layer.index)]
                for what, a, e in zip(names, actual, expected, strict=True):
                    worst = max(worst, _compare(layer.index, what, a, e, tolerance, cases[n].label))
            model.weights = None  # the first layer's copies, no longer run
            _release(layers[layer.index])
    return Proof(len(stamped), len(first), worst, time.perf_counter() - start, len(later))


def _how_many(first: int, later: int) -> str:
    return f"{first} cases" if first == later else f"{first} cases (the first of each kind), {later} (the others)"


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor as numpy (bfloat16 as ml_dtypes', which onnx.reference takes)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def reference_session(model: onnx.ModelProto, rename: Callable[[onnx.ModelProto], object] | None = None):
    """onnx.reference with the rotary op (``op.onnx_op``): for bfloat16 layers, which onnxruntime's CPU provider
    does not run."""
    from onnx.reference import ReferenceEvaluator

    from rope_export.op.onnx_op import RotaryEmbedding

    if rename is not None:
        rename(model)
    return ReferenceEvaluator(model, new_ops=[RotaryEmbedding])


def _release(layer: torch.nn.Module) -> None:
    """Give back the mapped checkpoint pages of a layer's parameters (nothing for memory the process owns)."""
    from rope_export.files.mapped import release

    for parameter in layer.parameters():
        release(parameter.data_ptr(), parameter.numel() * parameter.element_size())


def _compare(index: int, what: str, actual: np.ndarray, expected: np.ndarray, tolerance, label: str) -> float:
    """The largest error over its bound; LayerMismatch past 1."""
    if actual.shape != expected.shape:
        raise LayerMismatch(f"stamped layer {index}'s {what} has shape {actual.shape}, the model's {expected.shape} "
                            f"({label})")
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    bound = tolerance.at_scale_of(e)
    error = np.abs(a - e)
    ratio = float(np.max(error / (bound.atol + bound.rtol * np.abs(e)))) if error.size else 0.0
    if not np.isfinite(ratio) or ratio > 1.0:
        raise LayerMismatch(f"stamped layer {index}'s {what} differs from the model's layer {index} by "
                            f"{float(np.nanmax(error)):.3g} (op tolerance {bound.atol:.3g} + {bound.rtol:.3g}x; "
                            f"{label})")
    return ratio
