"""Rotary nodes in a graph, and each one cut out with what computes its caches (a "slice").

Which node carries a rotation (ours, its TensorRT plugin form, the standard op as "onnx",
onnxruntime's contrib op as "ort") is ``rope_export.op.nodes.rotary_kind``'s, the one classifier.

A slice is the rotary node plus every node its cos/sin/position inputs come from, back to graph
inputs and initializers; its X becomes an input. Run alone it rotates random X at any positions,
which is how ``check`` sweeps every cache row cheaply (``cache_rows.py``). Slices that compute the
same caches (q and k, every layer) are swept once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx
from onnx import external_data_helper, helper

from rope_export.check.model_file import FLOAT_ELEM_TYPES, ModelFile, TensorSpec, tensor_nbytes
from rope_export.op.nodes import CONTRACT_KINDS, rotary_kind

# positions of X, cos, sin, position_ids among the node's inputs, per kind
INPUT_ORDER = {"rope_export": (0, 1, 2, 3), "trt-plugin": (0, 1, 2, 3), "onnx": (0, 1, 2, 3), "ort": (0, 2, 3, 1)}
MAX_SLICE_NODES = 200
MAX_SLICE_BYTES = 256 * 2**20


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


@dataclass(frozen=True)
class RotaryNode:
    node: onnx.NodeProto
    kind: str
    x: str
    cos: str
    sin: str
    position_ids: str  # "" without

    @property
    def label(self) -> str:
        return self.node.name or f"{self.node.op_type} -> {self.node.output[0]}"

    @property
    def interleaved(self) -> int:
        return int(_attr(self.node, "interleaved", 0))

    @property
    def num_heads(self) -> int:
        return int(_attr(self.node, "num_heads", 0))

    @property
    def rotary_embedding_dim(self) -> int:
        return int(_attr(self.node, "rotary_embedding_dim", 0))


def rotary_nodes(graph: onnx.GraphProto) -> list[RotaryNode]:
    found = []
    for node in graph.node:
        kind = rotary_kind(node)
        if kind is None or len(node.input) < 3:
            continue
        inputs = list(node.input) + [""] * 4
        x, cos, sin, pos = (inputs[i] for i in INPUT_ORDER[kind])
        found.append(RotaryNode(node, kind, x, cos, sin, pos))
    return found


def has_contract_nodes(graph: onnx.GraphProto) -> bool:
    return any(r.kind in CONTRACT_KINDS for r in rotary_nodes(graph))


def rotary_width(rn: RotaryNode, x: TensorSpec | None) -> tuple[int | None, int | None]:
    """(channels rotated, heads x head_dim of X) when the file's static shapes say so."""
    if x is None or x.dims is None or len(x.dims) not in (3, 4):
        return None, None
    if len(x.dims) == 4:
        heads, head_dim = x.dims[1], x.dims[3]
    else:
        hidden, heads = x.dims[2], rn.num_heads
        head_dim = hidden // heads if isinstance(hidden, int) and heads else None
    if not isinstance(head_dim, int) or not isinstance(heads, int):
        return rn.rotary_embedding_dim or None, None
    return rn.rotary_embedding_dim or head_dim, heads * head_dim


@dataclass
class RotarySlice:
    """A rotary node with what computes its caches, as a model of its own."""

    nodes: list[RotaryNode]  # every node whose caches this slice computes (q and k, every layer)
    chosen: RotaryNode  # the one cut out (the narrowest X)
    model: onnx.ModelProto
    x: TensorSpec
    graph_inputs: list[TensorSpec]  # the file's inputs the caches come from (position_ids)
    rotary_dim: int | None
    tables: dict[str, str] = field(default_factory=dict)  # "cos"/"sin" -> stored [rows, rd/2] initializer
    # the integer graph inputs the node's positions come from (found by data flow, whatever their names)
    position_inputs: list[TensorSpec] = field(default_factory=list)
    # the nodes computing the node's position_ids from those inputs (None: it reads a graph input as it is)
    positions_model: onnx.ModelProto | None = None
    # the stored table the caches are cut from (Meta's freqs_cis as [rows, rd/2, 2]) and its rows
    table: str | None = None
    table_rows: int | None = None

    @property
    def label(self) -> str:
        more = f" (+{len(self.nodes) - 3})" if len(self.nodes) > 3 else ""
        names = ", ".join(n.label for n in self.nodes[:3]) + more
        return f"{self.chosen.kind} node{'s' * (len(self.nodes) > 1)} {names}"


class _Walk:
    """Ancestors of some values, stopping at graph inputs, initializers and a cut value."""

    def __init__(self, mf: ModelFile, cut: str):
        self.mf = mf
        self.producers = mf.nodes_by_output()
        self.graph_inputs = {s.name for s in mf.inputs}
        self.cut = cut

    def ancestors(self, names) -> tuple[list[onnx.NodeProto], set[str], set[str]]:
        """(nodes in graph order, initializers reached, graph inputs reached)."""
        seen_nodes: dict[int, onnx.NodeProto] = {}
        inits, inputs = set(), set()
        stack = [n for n in names if n]
        visited = set()
        while stack:
            name = stack.pop()
            if name in visited or not name:
                continue
            visited.add(name)
            if name == self.cut:
                continue
            if name in self.mf.initializer_names:
                inits.add(name)
            elif name in self.graph_inputs:
                inputs.add(name)
            elif name in self.producers:
                node = self.producers[name]
                if id(node) not in seen_nodes:
                    seen_nodes[id(node)] = node
                    if len(seen_nodes) > MAX_SLICE_NODES:
                        raise _TooBig(f"its caches come from more than {MAX_SLICE_NODES} nodes")
                    stack.extend(node.input)
                    for attr in node.attribute:  # subgraphs (If/Loop) read outer values too
                        if attr.type == onnx.AttributeProto.GRAPH:
                            raise _TooBig("its caches come through a control-flow node")
        order = {id(n): i for i, n in enumerate(self.mf.proto.graph.node)}
        return sorted(seen_nodes.values(), key=lambda n: order[id(n)]), inits, inputs


class _TooBig(Exception):
    pass


def _signature(rn: RotaryNode, nodes: list[onnx.NodeProto], rotary_dim) -> tuple:
    """What the slice computes, names of intermediate values aside (so shared caches compare equal)."""
    index: dict[str, tuple] = {}
    sig = []
    for node in nodes:
        ins = tuple(index.get(i, ("v", i)) for i in node.input)
        sig.append((node.domain, node.op_type, ins, tuple(str(a) for a in node.attribute)))
        for k, out in enumerate(node.output):
            index[out] = ("n", len(sig) - 1, k)
    def canon(v):
        return index.get(v, ("v", v))

    return (tuple(sig), rn.kind, canon(rn.cos), canon(rn.sin), canon(rn.position_ids), rn.interleaved, rotary_dim)


def _tensor_in_memory(mf: ModelFile, name: str) -> onnx.TensorProto:
    tensor = onnx.TensorProto()
    tensor.CopyFrom(mf.initializer(name))
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        external_data_helper.load_external_data_for_tensor(tensor, str(mf.base_dir))
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return tensor


def _value_info(spec: TensorSpec) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(spec.name, spec.elem_type, None if spec.dims is None else list(spec.dims))


def rotary_slices(mf: ModelFile) -> tuple[list[RotarySlice], list[str]]:
    """One slice per distinct cache computation, and notes on the nodes that could not be cut out."""
    notes: list[str] = []
    groups: dict[tuple, list] = {}
    for rn in rotary_nodes(mf.proto.graph):
        x = mf.value_type(rn.x)
        _check_types(rn, x, mf.value_type(rn.cos))
        rotary_dim, width = rotary_width(rn, x)
        if x is None or x.dims is None or width is None:
            notes.append(f"{rn.label}: X has no static head size in the file, so the node cannot be run alone")
            continue
        walk = _Walk(mf, cut=rn.x)
        try:
            nodes, inits, inputs = walk.ancestors([rn.cos, rn.sin, rn.position_ids])
        except _TooBig as why:
            notes.append(f"{rn.label}: not run alone, {why}")
            continue
        # An audio encoder's positions follow its input's length through convolutions (X's length is another
        # symbol): not a sweep's axis. A float input whose lengths are X's own (positions = arange over its
        # sequence) is swept like a positions input.
        x_symbols = {d for d in x.dims if isinstance(d, str)}
        floats = sorted(s.name for s in mf.inputs if s.name in inputs and s.is_float
                        and (s.dims is None or not {d for d in s.dims if isinstance(d, str)} <= x_symbols))
        if floats:
            notes.append(f"{rn.label}: not run alone, its positions come from the length of {', '.join(floats)} "
                         "through the model's own arithmetic; the cases cover it")
            continue
        if sum(tensor_nbytes(mf.initializer(n)) for n in inits) > MAX_SLICE_BYTES:
            notes.append(f"{rn.label}: not run alone, its caches come from more than {MAX_SLICE_BYTES >> 20} MB of "
                         "weights")
            continue
        key = _signature(rn, nodes, rotary_dim)
        groups.setdefault(key, []).append((width, rn, x, nodes, inits, inputs, rotary_dim))
    slices = []
    for members in groups.values():
        width, rn, x, nodes, inits, inputs, rotary_dim = min(members, key=lambda m: m[0])
        slices.append(_build_slice(mf, [m[1] for m in members], rn, x, nodes, inits, inputs, rotary_dim))
    return slices, notes


def _check_types(rn: RotaryNode, x: TensorSpec | None, cos: TensorSpec | None) -> None:
    """Refuse a rotary node whose X and caches break the op contract's types (float64 caches): no runner has a
    kernel for it, so there is nothing to compare (op.contract.check_dtypes, the contract's own rule)."""
    from rope_export.check.model_file import CheckError
    from rope_export.op.contract import check_dtypes

    if x is None or cos is None:
        return
    names = [helper.tensor_dtype_to_np_dtype(t).name for t in (x.elem_type, cos.elem_type)]
    try:
        check_dtypes(*names, None)
    except ValueError as exc:
        raise CheckError(f"{rn.label}: {exc}; no runner has a kernel for these types, so this file cannot be "
                         "checked: store X as float32, float16 or bfloat16 and the caches as float32 or in X's type "
                         "(re-export the file)") from None


def _build_slice(mf, members, rn, x, nodes, inits, inputs, rotary_dim) -> RotarySlice:
    graph_inputs = [s for s in mf.inputs if s.name in inputs]
    x_spec = TensorSpec(rn.x, x.elem_type, x.dims)
    output = helper.make_tensor_value_info(rn.node.output[0], x.elem_type, list(x.dims))  # Y has X's shape
    graph = helper.make_graph(
        [*nodes, rn.node], f"rotary slice of {rn.label}", [_value_info(x_spec), *map(_value_info, graph_inputs)],
        [output], initializer=[_tensor_in_memory(mf, n) for n in sorted(inits)],
    )
    model = helper.make_model(graph, opset_imports=list(mf.proto.opset_import), ir_version=mf.proto.ir_version)
    model.functions.extend(mf.proto.functions)
    tables = _stored_tables(mf, rn, rotary_dim)
    positions, positions_model = _positions_of(mf, rn, graph_inputs)
    return RotarySlice(members, rn, model, x_spec, graph_inputs, rotary_dim, tables, positions, positions_model,
                       *_table(mf, nodes, inits))


_CUTTING_OPS = ("Gather", "GatherND", "GatherElements", "Slice")


def _table(mf: ModelFile, nodes: list[onnx.NodeProto], inits: set[str]) -> tuple[str | None, int | None]:
    """(the table the caches are cut from: an initializer a Gather/Slice reads rows of, the positions it holds: its
    first dim past leading 1s), the one of fewest rows where several; (None, None) when there is none."""
    cut = {n.input[0] for n in nodes if n.op_type in _CUTTING_OPS and n.domain in ("", "ai.onnx") and n.input}
    found = []
    for name in sorted(inits & cut):
        tensor = mf.initializer(name)
        dims = list(tensor.dims)
        while len(dims) > 2 and dims[0] == 1:
            dims = dims[1:]
        if tensor.data_type in FLOAT_ELEM_TYPES and len(dims) >= 2 and dims[0] > 1:
            found.append((int(dims[0]), name))
    rows, name = min(found) if found else (None, None)
    return name, rows


def _positions_of(mf: ModelFile, rn: RotaryNode, graph_inputs: list[TensorSpec]):
    """(the integer graph inputs the node's positions come from, a model computing its position_ids from the
    slice's inputs when they are not one of those as it is). Without position_ids the positions are what
    the per-token caches are computed from."""
    nodes, inits, reached = _Walk(mf, cut=rn.x).ancestors([rn.position_ids] if rn.position_ids else [rn.cos, rn.sin])
    integer = [s for s in graph_inputs if s.name in reached and not s.is_float and s.dtype.kind in "iu"]
    if not rn.position_ids or rn.position_ids in {s.name for s in graph_inputs}:
        return integer, None
    graph = helper.make_graph(
        nodes, "positions", [_value_info(s) for s in graph_inputs],
        [helper.make_tensor_value_info(rn.position_ids, onnx.TensorProto.INT64, None)],
        initializer=[_tensor_in_memory(mf, n) for n in sorted(inits)])
    model = helper.make_model(graph, opset_imports=list(mf.proto.opset_import), ir_version=mf.proto.ir_version)
    model.functions.extend(mf.proto.functions)
    return integer, model


def _stored_tables(mf: ModelFile, rn: RotaryNode, rotary_dim: int | None) -> dict[str, str]:
    """The [rows, rd/2] float initializers the node's cos and sin come from, when each side has one."""
    if rotary_dim is None:
        return {}
    walk = _Walk(mf, cut=rn.x)
    found = {}
    sides = {"cos": walk.ancestors([rn.cos])[1], "sin": walk.ancestors([rn.sin])[1]}
    for role, other in (("cos", "sin"), ("sin", "cos")):
        own = [n for n in sides[role] - sides[other] if _is_table(mf.initializer(n), rotary_dim // 2)]
        if len(own) == 1:
            found[role] = own[0]
    return found if len(found) == 2 else {}


def _is_table(tensor: onnx.TensorProto, half: int) -> bool:
    return tensor.data_type in FLOAT_ELEM_TYPES and len(tensor.dims) == 2 and tensor.dims[1] == half


def tables_by_shape(mf: ModelFile, rows: int, half: int) -> list[str]:
    """Initializers of shape [rows, rd/2] read by a Gather (the caches of a file lowered to plain ops)."""
    gathered = {n.input[0] for n in mf.proto.graph.node if n.op_type == "Gather" and n.input}
    return [t.name for t in mf.proto.graph.initializer
            if t.name in gathered and _is_table(t, half) and t.dims[0] == rows and math.prod(t.dims) > 0]
