"""Evaluate a few values of a graph on probe inputs, without the rest of the model.

The fusion rules decide what a matched site computes by running it: ``Probe.run(outputs, feeds)``
cuts the backward slice of ``outputs`` at the fed values and at constants, builds a small ONNX
model of that slice and runs it in onnxruntime (``onnx.reference`` when onnxruntime cannot). The
weights of the model are never read: only the slice's own constants (small shape constants, cos/sin
tables) are.

Symbolic dimensions get concrete sizes: each name its own small prime (``batch`` 3, ``seq`` 5, ...;
expressions such as ``s0 + s1`` or ``Min(64, seq)`` are evaluated), unless the caller fixes some.
Exporters do not always name a dimension the same way everywhere (the TorchScript exporter's
inferred shapes carry names of their own), so the shapes the probes use come first from onnx shape
inference run once on the model with the graph inputs at those sizes (data propagation resolves
the shape arithmetic), and only then from the symbolic names. A ``Shape`` of a value the feeds do
not reach is resolved from those shapes, so a Reshape whose target comes from another graph input's
shape still runs.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir

from rope_export.passes._values import const_array

SIZES = (3, 5, 7, 11, 13, 17, 19, 23, 29, 31)  # distinct, so no two axes can be confused
MAX_NODES = 400  # a slice larger than this is not a RoPE site
BROADCASTING = ("Mul", "Add", "Sub", "Div")  # elementwise ops whose inputs' non-1 dims must be equal


class ProbeError(Exception):
    """The values cannot be evaluated on their own; the message says why."""


class EvaluationFailed(ProbeError):
    """The slice ran and failed: the sizes given to its symbolic dims do not fit together."""


def _sympy_size(expr: str, sizes: dict[str, int], new_symbols: bool = True) -> int | None:
    """The value of a dim expression (``s0 + s1``, ``Min(64, seq)``); a symbol not in ``sizes`` gets a size of its
    own there (``new_symbols=False``: None instead)."""
    import sympy

    try:
        parsed = sympy.sympify(expr)
    except (sympy.SympifyError, TypeError, SyntaxError):
        return None
    for symbol in sorted(parsed.free_symbols, key=str):
        if not new_symbols and str(symbol) not in sizes:
            return None
        sizes.setdefault(str(symbol), SIZES[len(sizes) % len(SIZES)])
    value = parsed.subs({s: sizes[str(s)] for s in parsed.free_symbols})
    return int(value) if value.is_number and value == int(value) else None


class Probe:
    """Concrete sizes for the symbolic dims of one model, and evaluation of slices of its graph."""

    def __init__(self, model: ir.Model, sizes: dict[str, int] | None = None, infer: bool = True,
                 tables: frozenset[str] = frozenset()):
        self.model = model
        self.sizes: dict[str, int] = dict(sizes or {})
        self._inferred: dict[str, tuple[int, ...]] | None = None if infer else {}
        # graph inputs the caller says are cos/sin tables (``fuse(table_inputs=...)``): fed as tables, not noise
        self.tables = tables

    def by_axis(self) -> Probe:
        """Another assignment where the graph inputs' dims get sizes by axis (axis 0 of every input
        the same, ...): for files whose exporter named equal dims differently (torch.export's
        Dim.AUTO gives every input's batch its own symbol)."""
        sizes: dict[str, int] = {}
        for value in self.model.graph.inputs:
            for axis, d in enumerate(value.shape or ()):
                name = getattr(d, "value", None)
                if isinstance(name, str) and name.isidentifier():
                    sizes.setdefault(name, SIZES[axis % len(SIZES)])
        return Probe(self.model, sizes, tables=self.tables)

    def unified(self) -> Probe:
        """Another assignment where a graph input's dim that an elementwise op broadcasts against a dim of other
        symbols gets that dim's size: torch.export keeps such a dim a symbol of its own where it cannot state the
        relation (CogVideoX's rotary tables of ``image_seq`` rows beside the latent's ``frames*s42*s62`` tokens),
        and sized on its own it makes the site fail to run. The other dim's size is as inferred, else its
        expression evaluated with each symbol sized as a value inferred here has it."""
        inferred = self._inferred if self._inferred is not None else self._infer()
        names = {d for v in self.model.graph.inputs for d in self.symbols(v) if d}
        known = {k: v for k, v in self.sizes.items() if k in names}  # the inputs' own; inner symbols as inferred
        for value in _values(self.model.graph):
            for symbol, size in zip(self.symbols(value), inferred.get(value.name, ()), strict=False):
                if symbol and symbol.isidentifier():
                    known.setdefault(symbol, size)
        for symbol, size in self._reshaped_symbols(known).items():
            known.setdefault(symbol, size)
        sizes = dict(known)
        resized: set[str] = set()
        for node in self.model.graph:
            if node.op_type not in BROADCASTING or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2 \
                    or any(v is None for v in node.inputs):
                continue
            for mine, other in (node.inputs, node.inputs[::-1]):
                concrete = inferred.get(other.name) or (None,) * len(self.symbols(other))
                for name, their, size in zip(reversed(self.symbols(mine)), reversed(self.symbols(other)),
                                             reversed(concrete), strict=False):
                    if name not in names or name in resized or not their or their == name:
                        continue
                    size = size or _sympy_size(their, dict(known), new_symbols=False)
                    if size is not None and size > 1:
                        sizes[name] = size
                        resized.add(name)
        return Probe(self.model, sizes, tables=self.tables)

    def _reshaped_symbols(self, known: dict[str, int]) -> dict[str, int]:
        """Inner symbols sized by the target of a Reshape computed from the graph inputs' shapes alone: onnx's data
        propagation has no Div, so a latent cut into patches (Lumina 2's ``view(B, C, H // p, p, W // p, p)``) leaves
        its grid's symbols uninferred where no convolution sizes them."""
        found: dict[str, int] = {}
        for node in self.model.graph:
            if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                continue
            symbols = self.symbols(node.outputs[0])
            if not any(s and s.isidentifier() and s not in known and s not in found for s in symbols):
                continue
            try:
                (target,) = self.run([node.inputs[1]], {})
            except ProbeError:
                continue
            if len(target) == len(symbols) and (target > 0).all():
                for symbol, size in zip(symbols, target.tolist(), strict=True):
                    if symbol and symbol.isidentifier():
                        found.setdefault(symbol, int(size))
        return found

    def with_sizes(self, sizes: dict[str, int]) -> Probe:
        """Another assignment (only symbolic names are used then: no whole-model inference).
        Sizes of expressions (``Min(64, seq)``) are recomputed from the new names."""
        names = {k: v for k, v in self.sizes.items() if k.isidentifier()}
        return Probe(self.model, {**names, **sizes}, infer=False, tables=self.tables)

    def size(self, d) -> int | None:
        if isinstance(d, int):
            return d
        name = getattr(d, "value", None)
        if name is None:
            return None
        if name not in self.sizes:
            if name.isidentifier():
                self.sizes[name] = SIZES[len(self.sizes) % len(SIZES)]
            else:
                value = _sympy_size(name, self.sizes)
                if value is None:
                    return None
                self.sizes[name] = value
        return self.sizes[name]

    def shape(self, value: ir.Value) -> tuple[int, ...] | None:
        if self._inferred is None:
            self._inferred = self._infer()
        if value.name and value.name in self._inferred:
            return self._inferred[value.name]
        if value.shape is None:
            return None
        dims = tuple(self.size(d) for d in value.shape)
        return None if any(d is None for d in dims) else dims

    def _infer(self) -> dict[str, tuple[int, ...]]:
        """Concrete shapes of the graph's values with its inputs at this probe's sizes."""
        graph = self.model.graph
        for value in graph.inputs:  # the inputs' names get the first sizes
            for d in value.shape or ():
                self.size(d)
        sizes = dict(self.sizes)

        def infer(proto: onnx.ModelProto) -> onnx.ModelProto:
            for info in proto.graph.input:
                for d in info.type.tensor_type.shape.dim:
                    if d.dim_param in sizes:
                        d.dim_value = sizes[d.dim_param]
            for info in list(proto.graph.output) + list(proto.graph.value_info):
                info.type.tensor_type.ClearField("shape")  # re-inferred from the concrete inputs
            return onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)

        try:
            from onnx_ir.passes.common._c_api_utils import call_onnx_api

            inferred = call_onnx_api(infer, self.model)
        except Exception:  # noqa: BLE001 - inference is a help, the symbolic names remain
            return {}
        shapes = {}
        for info in list(inferred.graph.value_info) + list(inferred.graph.output):
            dims = info.type.tensor_type.shape.dim
            if info.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                shapes[info.name] = tuple(d.dim_value for d in dims)
        return shapes

    def symbols(self, value: ir.Value) -> list[str | None]:
        """The symbolic names of a value's dims (None for static or unknown ones)."""
        if value.shape is None:
            return []
        return [None if isinstance(d, int) else getattr(d, "value", None) for d in value.shape]

    # -- evaluation ------------------------------------------------------------------------------
    def run(self, outputs: list[ir.Value], feeds: dict[ir.Value, np.ndarray], runtime: str = "auto",
            new_ops=()) -> list[np.ndarray]:
        """Evaluate ``outputs`` from ``feeds`` (values -> arrays) and the graph's constants.

        ``runtime``: "auto" (onnxruntime, else onnx.reference), or only "onnxruntime" or only
        "reference" (``new_ops``: extra OpRun classes for it), when the runtime itself is under test."""
        wanted = [v for v in outputs if v not in feeds]
        results = dict(zip(wanted, self._evaluate(wanted, feeds, runtime, new_ops), strict=True)) if wanted else {}
        return [np.asarray(feeds[v]) if v in feeds else results[v] for v in outputs]

    def _evaluate(self, outputs: list[ir.Value], feeds: dict[ir.Value, np.ndarray], runtime: str = "auto",
                  new_ops=()) -> list[np.ndarray]:
        nodes, inputs = self._slice(outputs, feeds)
        unnamed = [v for v in {v for n in nodes for v in list(n.inputs) + list(n.outputs) if v is not None}
                   | set(inputs) if not v.name]
        names = self._names(list(inputs) + [v for n in nodes for v in list(n.inputs) + list(n.outputs)
                                             if v is not None])
        for v in unnamed:  # serialization writes value names; unnamed ones get a temporary one
            v.name = names[v]
        try:
            protos = [ir.serde.serialize_node(n) for n in nodes]
        finally:
            for v in unnamed:
                v.name = None
        graph_inputs, arrays = [], {}
        for value, array in inputs.items():
            array = np.asarray(array)
            graph_inputs.append(onnx.helper.make_tensor_value_info(
                names[value], onnx.helper.np_dtype_to_tensor_dtype(array.dtype), array.shape))
            arrays[names[value]] = array
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(names[v]) for v in outputs]
        graph = onnx.helper.make_graph(protos, "probe", graph_inputs, graph_outputs)
        opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in self.model.opset_imports.items()]
        proto = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=self.model.ir_version or 10)
        if runtime != "reference":
            try:
                return _run_ort(proto, arrays)
            except Exception as exc:  # noqa: BLE001 - fall back to the reference evaluator (bf16, unusual ops)
                if runtime == "onnxruntime":
                    raise EvaluationFailed(_failure("onnxruntime", exc)) from None
        try:
            return _run_reference(proto, arrays, new_ops)
        except Exception as exc:  # noqa: BLE001
            raise EvaluationFailed(_failure("onnx.reference" if runtime == "reference" else "", exc)) from None

    def leaves(self, outputs: list[ir.Value], feeds: dict[ir.Value, np.ndarray]) -> list[ir.Value]:
        """The graph inputs (other than ``feeds``) that evaluating ``outputs`` needs."""
        missing: list[ir.Value] = []
        self._slice(outputs, feeds, missing)
        return missing

    def _slice(self, outputs, feeds, missing: list | None = None) -> tuple[list[ir.Node], dict[ir.Value, np.ndarray]]:
        reaches: dict[ir.Value, bool] = {}

        def reach(v: ir.Value | None, depth: int = 0) -> bool:
            if v is None or depth > 200:
                return False
            if v in feeds:
                return True
            if v not in reaches:
                node = v.producer()
                reaches[v] = node is not None and any(reach(i, depth + 1) for i in node.inputs)
            return reaches[v]

        inputs: dict[ir.Value, np.ndarray] = dict(feeds)
        chosen: set[ir.Node] = set()
        stack = list(outputs)
        seen: set[ir.Value] = set()
        while stack:
            v = stack.pop()
            if v is None or v in seen or v in feeds:
                continue
            seen.add(v)
            constant = const_array(v)
            if constant is not None:
                inputs[v] = constant
                continue
            node = v.producer()
            if node is None and missing is not None:
                missing.append(v)
                continue
            if node is None:
                raise ProbeError(f"it depends on the graph input {v.name!r}, which the check does not feed")
            if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and not reach(node.inputs[0]):
                inputs[v] = self._shape_value(node)
                continue
            if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
                raise ProbeError(f"it contains a {node.op_type} with a subgraph")
            chosen.add(node)
            if len(chosen) > MAX_NODES:
                raise ProbeError(f"the site spans more than {MAX_NODES} nodes")
            stack.extend(node.inputs)
        graph = outputs[0].graph
        order = {n: i for i, n in enumerate(graph)} if graph is not None else {}
        return sorted(chosen, key=lambda n: order.get(n, 0)), inputs

    def _shape_value(self, node: ir.Node) -> np.ndarray:
        source = node.inputs[0]
        shape = self.shape(source)
        if shape is None:
            raise ProbeError(f"the shape of {source.name!r} is not known (run shape inference)")
        if node.op_type == "Size":
            return np.array(int(np.prod(shape)), dtype=np.int64)
        start, end = node.attributes.get("start"), node.attributes.get("end")
        lo = start.as_int() if start is not None else 0
        hi = end.as_int() if end is not None else len(shape)
        return np.array(shape[slice(lo, hi)], dtype=np.int64)

    @staticmethod
    def _names(values) -> dict[ir.Value, str]:
        names: dict[ir.Value, str] = {}
        fresh = (f"probe_{i}" for i in itertools.count())
        taken = {v.name for v in values if v.name}
        for v in values:
            if v in names:
                continue
            if v.name:
                names[v] = v.name
            else:
                name = next(fresh)
                while name in taken:
                    name = next(fresh)
                names[v] = name
        return names


def _run_ort(proto: onnx.ModelProto, arrays: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in arrays.items() if k in wanted})


def _failure(runtime: str, exc: Exception) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:160]
    where = f" on {runtime}" if runtime else ""
    return f"the matched ops could not be evaluated{where} ({type(exc).__name__}: {text})"


def _run_reference(proto: onnx.ModelProto, arrays: dict, new_ops=()) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    from rope_export.op.onnx_op import RotaryEmbedding

    return ReferenceEvaluator(proto, new_ops=[RotaryEmbedding, *new_ops]).run(None, arrays)


def _values(graph: ir.Graph):
    """The graph's inputs and every node's outputs."""
    yield from graph.inputs
    for node in graph:
        yield from node.outputs
