"""onnxruntime on a file too large for one session: the model run in consecutive pieces.

onnxruntime's CPU provider keeps a float32 copy of half-precision weights (about 3x their bytes
resident), so one session on an 8B-class fp16 file (16 GB of weights) needs about 48 GB. Here the
graph is cut, in topological order, into pieces whose sessions each fit a memory budget
(``plan_pieces``). Each piece becomes a model of its own: its nodes, the initializers they read
(still pointing into the file's external data, so nothing is copied on disk or in memory beyond
the piece), the values it takes from the feeds or from earlier pieces as inputs, and the values
that later pieces or the graph's outputs need as outputs. ``StreamedRunner`` opens one piece's
session, runs every case through it, keeps only the values that cross to later pieces (activations,
present keys/values: megabytes), frees the session, then opens the next.

Nothing depends on layer names: a cut goes where the fewest values cross it (between two decoder
layers only the residual stream and the values every layer shares do), among the positions that
keep the piece within budget and at least half full. A node whose weights alone exceed the budget
gets a piece of its own.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from rope_export.check.model_file import CheckError, free_memory, tensor_nbytes
from rope_export.common.bounds import format_bytes

HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _tensor_session_bytes(tensor: onnx.TensorProto) -> int:
    """About what an onnxruntime CPU session holds for one initializer: the tensor, plus a float32 copy
    of a half-precision one (measured: 6.1 GB for a Llama-3.2-1B-shaped fp16 file of 2.3 GB, on a CPU
    without fp16 GEMM), plus a fifth for the rest."""
    nbytes = tensor_nbytes(tensor)
    return 3 * nbytes if tensor.data_type in HALF_TYPES else nbytes + nbytes // 5


def session_costs(graph: onnx.GraphProto) -> dict[str, int]:
    """What a session holds for each initializer (``_tensor_session_bytes``), plus its size again where a
    node reads nothing but initializers: onnxruntime folds such a node (the Transpose of a tied embedding)
    into one more tensor (measured: 2.1 GB for the piece of a 1B file that holds its 0.49 GB tied
    embedding and that Transpose)."""
    tensors = {t.name: t for t in graph.initializer}
    cost = {name: _tensor_session_bytes(t) for name, t in tensors.items()}
    for node in graph.node:
        inputs = [n for n in node.input if n]
        if inputs and all(n in tensors for n in inputs) and not any(True for _ in _subgraphs(node)):
            for name in inputs:
                cost[name] += tensor_nbytes(tensors[name])
    return cost


# -- the graph's dependencies ---------------------------------------------------------------------

def _subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def used_names(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads: its inputs, and the outer values its subgraphs (If, Loop, Scan) read."""
    names = [n for n in node.input if n]
    for graph in _subgraphs(node):
        defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
        for inner in graph.node:
            names += [n for n in used_names(inner) if n not in defined]
            defined.update(o for o in inner.output if o)
    return list(dict.fromkeys(names))


def topological_order(graph: onnx.GraphProto) -> list[int]:
    """Node indices in an order where every value is produced before it is read (the file's own order
    when it already is one, as ONNX requires)."""
    producer = {out: k for k, node in enumerate(graph.node) for out in node.output if out}
    needs = [{producer[n] for n in used_names(node) if n in producer and producer[n] != k}
             for k, node in enumerate(graph.node)]
    readers: dict[int, list[int]] = {}
    for k, deps in enumerate(needs):
        for d in deps:
            readers.setdefault(d, []).append(k)
    waiting = [len(deps) for deps in needs]
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for r in readers.get(k, ()):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(graph.node):
        raise CheckError("the graph has a cycle, so it cannot be run in pieces; fix the file")
    return order


# -- the plan -------------------------------------------------------------------------------------

@dataclass
class Piece:
    nodes: list[int]  # indices into the graph's nodes, in running order
    initializers: list[str]
    inputs: list[str]  # from the feeds or from earlier pieces
    outputs: list[str]  # what later pieces or the graph's outputs need
    weight_bytes: int
    session_bytes: int  # its initializers' ``session_costs``

    def describe(self, graph: onnx.GraphProto) -> str:
        first, last = (graph.node[self.nodes[i]] for i in (0, -1))
        names = f"{first.name or first.op_type} .. {last.name or last.op_type}"
        return f"{len(self.nodes)} nodes ({names}), {format_bytes(self.weight_bytes)} of weights"


def plan_pieces(graph: onnx.GraphProto, budget: int) -> list[Piece]:
    """Consecutive pieces of ``graph`` whose sessions each take at most ``budget`` bytes (``session_costs``),
    cut where the fewest values cross."""
    order = topological_order(graph)
    nodes = [graph.node[k] for k in order]
    reads = [used_names(node) for node in nodes]
    tensors = {t.name: t for t in graph.initializer}
    cost = session_costs(graph)
    ranges = _cut(reads, cost, _live_after(nodes, reads), budget)
    producer = {out: p for p, node in enumerate(nodes) for out in node.output if out}
    last_read: dict[str, int] = {}
    for p, names in enumerate(reads):
        for name in names:
            last_read[name] = p
    graph_outputs = {o.name for o in graph.output}
    pieces = []
    for start, end in ranges:
        inits, inputs, outputs = [], [], []
        for p in range(start, end + 1):
            for name in reads[p]:
                if name in tensors:
                    inits.append(name)
                elif not start <= producer.get(name, -1) <= end:
                    inputs.append(name)
            outputs += [o for o in nodes[p].output if o and (o in graph_outputs or last_read.get(o, -1) > end)]
        inits, inputs = list(dict.fromkeys(inits)), list(dict.fromkeys(inputs))
        pieces.append(Piece([order[p] for p in range(start, end + 1)], inits, inputs, outputs,
                            sum(tensor_nbytes(tensors[n]) for n in inits), sum(cost[n] for n in inits)))
    return pieces


def _live_after(nodes, reads) -> list[int]:
    """How many produced values cross a cut after each position (made before it, read after it)."""
    producer = {out: p for p, node in enumerate(nodes) for out in node.output if out}
    delta = [0] * (len(nodes) + 1)
    last_read: dict[str, int] = {}
    for p, names in enumerate(reads):
        for name in names:
            last_read[name] = p
    for name, made in producer.items():
        if last_read.get(name, -1) > made:
            delta[made] += 1
            delta[last_read[name]] -= 1
    live, running = [], 0
    for p in range(len(nodes)):
        running += delta[p]
        live.append(running)
    return live


def _cut(reads, cost, live, budget) -> list[tuple[int, int]]:
    """(first, last) positions of each piece: as far as the budget allows, then back to the position
    in the piece's second half (by weight) where the fewest values cross."""
    ranges, start, n = [], 0, len(reads)
    while start < n:
        seen: set[str] = set()
        total, filled, p = 0, [], start
        while p < n:
            new = {name for name in reads[p] if name in cost and name not in seen}
            add = sum(cost[name] for name in new)
            if p > start and total + add > budget:
                break
            seen |= new
            total += add
            filled.append(total)
            p += 1
        if p == n:
            ranges.append((start, n - 1))
            break
        candidates = [q for q in range(start, p) if filled[q - start] >= filled[-1] / 2]
        end = min(candidates, key=lambda q: (live[q], -q))
        ranges.append((start, end))
        start = end + 1
    return ranges


# -- one piece as a model of its own --------------------------------------------------------------

def piece_model(model: onnx.ModelProto, piece: Piece, types: dict[str, onnx.ValueInfoProto],
                arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The piece's nodes and initializers (external ones still naming the file's data), its inputs typed
    from ``types`` (else from the values computed for them), its outputs from ``types`` when known."""
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer}

    def value_info(name: str, array: np.ndarray | None = None) -> onnx.ValueInfoProto:
        if name in types:
            return types[name]
        if array is None:
            return helper.make_empty_tensor_value_info(name)
        elem = helper.np_dtype_to_tensor_dtype(array.dtype)
        return helper.make_tensor_value_info(name, elem, [f"{name}_dim{i}" for i in range(array.ndim)])

    sub = helper.make_graph(
        [graph.node[k] for k in piece.nodes], f"{graph.name} piece",
        [value_info(name, arrays.get(name)) for name in piece.inputs],
        [value_info(name) for name in piece.outputs],
        initializer=[tensors[name] for name in piece.initializers])
    out = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    out.functions.extend(model.functions)
    return out


def known_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Typed values of the graph (its own value_info, else onnx shape inference on the graph alone)."""
    graph = model.graph
    values = list(graph.value_info)
    if len(values) < len(graph.node) // 2:
        try:
            values = list(onnx.shape_inference.infer_shapes(model).graph.value_info)
        except Exception:  # noqa: BLE001 - best effort: pieces type the rest from the computed values
            pass
    typed = {v.name: v for v in [*values, *graph.input, *graph.output]
             if v.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED}
    return typed


# -- the runner ----------------------------------------------------------------------------------

def constant_values(graph: onnx.GraphProto, pieces: list[Piece]) -> set[str]:
    """Values computed from the weights alone (a Transpose of a tied embedding for the head): the same in every
    case, so they are held once between pieces, not once per case (at 1B: 525 MB times the cases)."""
    known = {t.name for t in graph.initializer}
    constant: set[str] = set()
    for piece in pieces:  # the pieces run in topological order
        for k in piece.nodes:
            node = graph.node[k]
            if node.op_type.startswith(("Random", "Bernoulli", "Multinomial")):
                continue
            if all(not name or name in known or name in constant for name in used_names(node)):
                constant.update(out for out in node.output if out)
    return constant


class StreamedRunner:
    """Runs every case through one piece's session at a time (see the module doc).

    ``model`` is the graph to run, its external initializers resolved against ``base_dir``; ``open_session``
    makes an onnxruntime session from a serialized piece and that folder."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None, pieces: list[Piece], open_session,
                 name: str = "onnxruntime-cpu"):
        self.model, self.base_dir, self.pieces = model, base_dir, pieces
        self.open_session, self.name = open_session, name
        self.kept_bytes = 0  # the most bytes of values held between two pieces, all cases together

    def run_cases(self, cases, say=lambda message: None) -> tuple[list[dict[str, np.ndarray]], float | None]:
        graph = self.model.graph
        wanted = [o.name for o in graph.output]
        last_piece: dict[str, int] = {}
        for k, piece in enumerate(self.pieces):
            for name in piece.inputs:
                last_piece[name] = k
        types = known_types(self.model)
        values = [dict(case.feeds) for case in cases]
        constant = constant_values(graph, self.pieces)
        seconds = [0.0] * len(cases)
        for k, piece in enumerate(self.pieces, 1):
            if not piece.outputs:  # nothing later reads what these nodes make
                continue
            say(f"piece {k}/{len(self.pieces)}: opening a session on {piece.describe(graph)}")
            sub = piece_model(self.model, piece, types, values[0])
            session = self.open_session(sub.SerializeToString(), self.base_dir)
            del sub
            say(f"piece {k}/{len(self.pieces)}: running {len(cases)} cases")
            for c, held in enumerate(values):
                feeds = {name: held[name] for name in piece.inputs}
                started = time.perf_counter()
                results = session.run(piece.outputs, feeds)
                seconds[c] += time.perf_counter() - started
                held.update(zip(piece.outputs, results, strict=True))
                if c:  # one array for what every case computes alike (constant_values)
                    held.update({name: values[0][name] for name in piece.outputs if name in constant})
                for name in piece.inputs:  # drop what no later piece reads
                    if last_piece[name] == k - 1 and name not in wanted and name not in cases[c].feeds:
                        del held[name]
            del session
            free_memory(piece.weight_bytes)  # the session's weights, before the next piece's
            kept = {id(a): a.nbytes for held in values for n, a in held.items() if n not in cases[0].feeds}
            self.kept_bytes = max(self.kept_bytes, sum(kept.values()))
        outputs = []
        for held in values:
            missing = [name for name in wanted if name not in held]
            if missing:
                raise RuntimeError(f"the pieces produced no value for output(s) {missing}")
            outputs.append({name: held[name] for name in wanted})
        return outputs, float(np.median(seconds)) * 1e3 if seconds else None
