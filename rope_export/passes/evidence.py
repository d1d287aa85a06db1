"""How many rotations a graph holds, counted from its own evidence, independent of the fusion rules.

A decomposed rotation multiplies a tensor by cos and a tensor by sin and adds (or subtracts) the
two products. The count follows that evidence and nothing else:

* *trig values*: the outputs of Cos and Sin, graph inputs the caller declares tables, and constant
  tables that come in cos/sin pairs (two float constants of one shape whose squares sum to one
  constant, ``cos² + sin² = m²``: the tables an export folded), carried through the ops that move
  or select their elements (Unsqueeze, Reshape, Expand, Gather, Slice, Concat, Cast, ...) and
  through scaling by a constant;
  one table may hold both (a trailing pair axis, two halves, alternate columns);
* *products*: a Mul of a trig value with a value that is not one (carried through Cast, Neg and
  the ops that move elements);
* *rotation terms*: an Add or Sub of two products;
* *rotations*: terms grouped when they share a rotated operand (``y1 = x1*c - x2*s`` and
  ``y2 = x1*s + x2*c`` are one rotation of pairs) or meet in one join (the Concat of a stack).

A look-alike with that arithmetic (sin of other angles than cos) is counted too: the fusion's
report then says why it was left alone. ``count_rotations(model)`` gives the number of such groups;
``fuse`` counts the graph before and after and reports "N rotations found, M fused".
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from rope_export.passes._values import const_array

MOVES = {"Unsqueeze", "Squeeze", "Reshape", "Expand", "Tile", "Gather", "GatherND", "GatherElements", "Slice",
         "Split", "Concat", "Transpose", "Cast", "Identity", "Flatten", "Neg"}
SCALES = {"Mul", "Div"}  # by a constant (a magnitude factor, torch.polar's ones)
PRODUCT_MOVES = {"Unsqueeze", "Squeeze", "Reshape", "Expand", "Transpose", "Cast", "Identity", "Flatten", "Neg"}
TERMS = {"Add", "Sub"}
MAX_TABLE = 1 << 22  # elements: a larger constant is a weight, not a cos/sin table


FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _constant_attribute(value: ir.Value):
    """The tensor of a Constant node's ``value`` attribute (its header: dtype and shape)."""
    node = value.producer()
    attribute = node.attributes.get("value") if node is not None and node.op_type == "Constant" else None
    return attribute.as_tensor() if attribute is not None else None


def _constant_tensor(value: ir.Value):
    """The tensor header behind a constant value (an initializer or a Constant node's output), else None."""
    if value.is_graph_input():
        return None
    return value.const_value if value.const_value is not None else _constant_attribute(value)


def _multiplied_constants(graph: ir.Graph) -> list[ir.Value]:
    """The constants that reach an operand of a multiply-add pair through element moves only.

    Found from the graph's structure first, so that only these are read: a weight (reached through
    MatMul, Gemm, Conv, never through moves alone) is never opened."""
    muls = []
    for node in graph:
        if node.op_type in TERMS and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
            sources = [_product_source(v) for v in node.inputs]
            if all(m is not None for m in sources):
                muls += sources
    found, seen = [], set()
    stack = [v for m in muls for v in m.inputs if v is not None]
    while stack and len(seen) < 10_000:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if _constant_tensor(value) is not None:
            found.append(value)
            continue
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Concat":
            stack.extend(v for v in node.inputs if v is not None)
        elif node.op_type in MOVES or node.op_type in SCALES:
            stack.extend(v for v in node.inputs[:1 if node.op_type in MOVES else 2] if v is not None)
    return found


def _product_source(value: ir.Value | None) -> ir.Node | None:
    """The Mul a value is, through Cast/Neg/element moves, or None."""
    for _ in range(8):
        node = value.producer() if value is not None else None
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Mul":
            return node
        if node.op_type not in PRODUCT_MOVES:
            return None
        value = node.inputs[0]
    return None


def _table_candidates(graph: ir.Graph) -> list[tuple[ir.Value, np.ndarray]]:
    """Float constants of at least 2 dims, every element in [-1, 1] (a cos/sin table's range, m <= 1),
    among those a multiply-add pair multiplies by."""
    found = []
    for value in _multiplied_constants(graph):
        tensor = _constant_tensor(value)
        if tensor is None or tensor.dtype not in FLOATS:
            continue
        size = int(np.prod(tensor.shape.numpy())) if tensor.shape is not None else 0
        if len(tensor.shape or ()) < 2 or not 2 <= size <= MAX_TABLE:
            continue
        array = const_array(value)
        if array is None:
            continue
        array = array.astype(np.float64)
        if np.all(np.abs(array) <= 1.0 + 1e-3):
            found.append((value, array))
    return found


def _unit(x: np.ndarray, y: np.ndarray) -> bool:
    """cos² + sin² is one constant (not 0) over the table, and the two are not the same table. Rows (last
    axis) where both are zero throughout are allowed: a padding position's row, which gives zeros, as the
    rotary op does with a zero cache row."""
    total = x * x + y * y
    if total.ndim >= 1 and total.size:
        rows = total.reshape(-1, total.shape[-1])
        dead = np.all(rows == 0, axis=-1)
        if dead.any() and not dead.all():
            total = rows[~dead]
    return bool(total.size and total.mean() > 1e-2 and np.ptp(total) <= 1e-3 * max(1.0, total.mean())
                and not np.array_equal(x, y))


def _halves(x: np.ndarray):
    """The ways one table holds both cos and sin: a trailing pair axis ([.., 2], torchtune and Meta's
    view_as_real), two halves (GPT-J's cat(sin, cos)) or alternate columns of its last axis, or any
    other axis of two (``stack((cos, sin))``)."""
    width = x.shape[-1]
    if width % 2 == 0:
        yield x[..., : width // 2], x[..., width // 2:]
        yield x[..., 0::2], x[..., 1::2]
    for axis in range(x.ndim):
        if x.shape[axis] == 2:
            yield np.take(x, 0, axis=axis), np.take(x, 1, axis=axis)


def _table_pairs(graph: ir.Graph) -> set[ir.Value]:
    """The constants that are cos/sin tables: two of one shape whose squares sum to one constant, or one
    that holds both along its last axis."""
    candidates = _table_candidates(graph)
    paired: set[ir.Value] = set()
    for i, (a, x) in enumerate(candidates):
        if any(_unit(c, s) for c, s in _halves(x)):
            paired.add(a)
        for b, y in candidates[i + 1:]:
            if x.shape == y.shape and _unit(x, y):
                paired |= {a, b}
    return paired


def _constant_like(value: ir.Value | None) -> bool:
    """A value made from constants and shapes only (``ones_like``: a magnitude for torch.polar)."""
    node = value.producer() if value is not None else None
    if value is None or const_array(value) is not None:
        return value is not None
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "ConstantOfShape":
        return True
    return node.op_type in ("Expand", "Tile", "Cast", "Identity") and _constant_like(node.inputs[0])


def _trig_values(graph: ir.Graph, tables: frozenset[str] = frozenset()) -> set[ir.Value]:
    trig = set(_table_pairs(graph)) | {v for v in graph.inputs if v.name in tables}
    for node in graph:  # topological order: one pass carries the mark forward
        if node.domain not in ("", "ai.onnx"):
            continue
        inputs = [v for v in node.inputs if v is not None]
        if node.op_type in ("Cos", "Sin"):
            trig.update(node.outputs)
        elif node.op_type in MOVES and inputs and inputs[0] in trig:
            trig.update(node.outputs)
        elif node.op_type == "Concat" and any(v in trig for v in inputs):
            trig.update(node.outputs)
        elif node.op_type in SCALES and len(inputs) == 2 and (
                (inputs[0] in trig and _constant_like(inputs[1])) or (inputs[1] in trig and _constant_like(inputs[0]))):
            trig.update(node.outputs)
    return trig


def rotation_terms(graph: ir.Graph, tables: frozenset[str] = frozenset()) -> list[tuple[ir.Node, set[ir.Value]]]:
    """(Add/Sub node, the rotated operands of its two products) for every rotation term."""
    trig = _trig_values(graph, tables)
    operands: dict[ir.Value, set[ir.Value]] = {}  # product (or a move of one) -> its non-trig operands
    terms = []
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs)
        if node.op_type == "Mul" and len(inputs) == 2 and (inputs[0] in trig) != (inputs[1] in trig):
            other = inputs[1] if inputs[0] in trig else inputs[0]
            if not _constant_like(other):  # a constant times cos is a scaled table, not a rotated tensor
                operands[node.outputs[0]] = {other}
        elif node.op_type in PRODUCT_MOVES and inputs and inputs[0] in operands:
            for out in node.outputs:
                operands[out] = operands[inputs[0]]
        elif node.op_type in TERMS and len(inputs) == 2 and inputs[0] in operands and inputs[1] in operands:
            terms.append((node, operands[inputs[0]] | operands[inputs[1]]))
    return terms


def _consumers_within(value: ir.Value, hops: int) -> set[ir.Node]:
    """The nodes that consume ``value`` within ``hops`` steps (element-moving ops only, then the join)."""
    seen, frontier = set(), [value]
    for _ in range(hops):
        nxt = []
        for v in frontier:
            for user, _index in v.uses():
                if user in seen:
                    continue
                seen.add(user)
                if user.op_type in ("Unsqueeze", "Reshape", "Cast", "Identity", "Concat"):
                    nxt.extend(user.outputs)
        frontier = nxt
    return {n for n in seen if n.op_type == "Concat"}


def count_rotations(model: ir.Model, tables: frozenset[str] = frozenset()) -> int:
    """Decomposed rotations in ``model``'s main graph (see the module doc); ``tables``: graph inputs the caller
    says are cos/sin tables (``fuse(table_inputs=...)``), trig values like the outputs of Cos and Sin."""
    terms = rotation_terms(model.graph, tables)
    parent = list(range(len(terms)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i, j):
        parent[find(i)] = find(j)

    by_operand: dict[ir.Value, int] = {}
    by_join: dict[ir.Node, int] = {}
    for i, (node, ops) in enumerate(terms):
        for value in ops:
            if value in by_operand:
                union(i, by_operand[value])
            by_operand.setdefault(value, i)
        for join in _consumers_within(node.outputs[0], 3):
            if join in by_join:
                union(i, by_join[join])
            by_join.setdefault(join, i)
    return len({find(i) for i in range(len(terms))})
