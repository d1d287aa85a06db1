"""Small read-only questions about onnx-ir values that the rules ask in their ``check``.

These answer "what is this value, statically?" (a constant, a shape-derived integer, a dtype, a
dimension); they never rewrite anything. The pattern matching itself is onnxscript's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

INT64_MAX = 9223372036854775807

FLOAT_TYPES = {
    ir.DataType.FLOAT: "float32",
    ir.DataType.FLOAT16: "float16",
    ir.DataType.BFLOAT16: "bfloat16",
}


def dtype_of(value: ir.Value | None) -> ir.DataType | None:
    if value is None or value.type is None:
        return None
    try:
        return value.dtype
    except Exception:  # noqa: BLE001 - non-tensor types
        return None


def dtype_name(dtype: ir.DataType | None) -> str:
    if dtype is None:
        return "an unknown type"
    return FLOAT_TYPES.get(dtype) or dtype.name.lower()


def rank_of(value: ir.Value | None) -> int | None:
    if value is None or value.shape is None:
        return None
    return value.shape.rank()


def dim(value: ir.Value | None, axis: int) -> int | None:
    """The static size of one axis (negative axes allowed), or None when unknown."""
    if value is None or value.shape is None:
        return None
    shape = value.shape
    rank = shape.rank()
    if not -rank <= axis < rank:
        return None
    d = shape[axis]
    return d if isinstance(d, int) else None


def same_dim(a: ir.Value, axis_a: int, b: ir.Value, axis_b: int) -> bool:
    """True only when both dims are provably equal (same int or same symbolic name)."""
    if a.shape is None or b.shape is None:
        return False
    try:
        da, db = a.shape[axis_a], b.shape[axis_b]
    except IndexError:
        return False
    if isinstance(da, int) and isinstance(db, int):
        return da == db
    if isinstance(da, ir.SymbolicDim) and isinstance(db, ir.SymbolicDim):
        return da.value is not None and da.value == db.value
    return False


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value as a NumPy array when it is an initializer or a Constant's output, else None."""
    if value is None:
        return None
    if value.is_graph_input():
        return None  # an initializer that is also a graph input can be overridden at run time
    try:
        tensor = ir.convenience.get_const_tensor(value)
    except ValueError:
        return None
    if tensor is None:
        return None
    try:
        return tensor.numpy()
    except Exception:  # noqa: BLE001 - external data that is not available
        return None


def static_ints(value: ir.Value | None, known: dict | None = None) -> list[int] | None:
    """Resolve a small int64 tensor computed from constants and static dims, or None.

    Handles the shape arithmetic that exporters leave around slice bounds, e.g. the TorchScript
    exporter's ``Unsqueeze(Cast(Div(Gather(Shape(x), 3), 2)))`` for ``x.shape[-1] // 2``.
    ``known`` maps values to dims established otherwise (list of int or None), used by Shape.
    """
    values = _partial_ints(value, 0, known or {})
    if values is None or any(v is None for v in values):
        return None
    return values


def _partial_ints(value: ir.Value | None, depth: int, known: dict) -> list[int | None] | None:
    """Like static_ints, but entries may be None (unknown) as long as the length is known."""
    if value is None or depth > 16:
        return None
    arr = const_array(value)
    if arr is not None:
        if arr.dtype.kind not in "iu" or arr.size > 64:
            return None
        return [int(v) for v in arr.reshape(-1)]
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    inputs = list(node.inputs)

    def sub(i: int) -> list[int | None] | None:
        return _partial_ints(inputs[i], depth + 1, known) if i < len(inputs) else None

    def full(i: int) -> list[int] | None:
        part = sub(i)
        return None if part is None or any(v is None for v in part) else part

    if op == "Shape":
        if inputs[0] is None:
            return None
        if inputs[0] in known:
            all_dims = list(known[inputs[0]])
        elif inputs[0].shape is not None:
            all_dims = [d if isinstance(d, int) else None for d in inputs[0].shape]
        else:
            return None
        start, end = node.attributes.get("start"), node.attributes.get("end")
        lo = start.as_int() if start is not None else 0
        hi = end.as_int() if end is not None else len(all_dims)
        return all_dims[slice(lo, hi)]
    if op in ("Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten"):
        return sub(0)
    if op == "Gather":
        data, idx = sub(0), full(1)
        if data is None or idx is None:
            return None
        try:
            return [data[i] for i in idx]
        except IndexError:
            return None
    if op == "Concat":
        out: list[int | None] = []
        for i in range(len(inputs)):
            part = sub(i)
            if part is None:
                return None
            out.extend(part)
        return out
    if op == "Slice":
        data, starts, ends = sub(0), full(1), full(2)
        steps = full(4) if len(inputs) > 4 and inputs[4] is not None else [1]
        if data is None or starts is None or ends is None or steps is None:
            return None
        return data[slice(starts[0], ends[0], steps[0])]
    if op in ("Div", "Mul", "Add", "Sub"):
        a, b = sub(0), sub(1)
        if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
        fns = {
            "Div": lambda x, y: None if y == 0 else x // y,
            "Mul": lambda x, y: x * y,
            "Add": lambda x, y: x + y,
            "Sub": lambda x, y: x - y,
        }
        return [None if x is None or y is None else fns[op](x, y) for x, y in zip(a, b, strict=True)]
    return None


def static_int(value: ir.Value | None) -> int | None:
    values = static_ints(value)
    if values is None or len(values) != 1:
        return None
    return values[0]


def static_length(value: ir.Value | None) -> int | None:
    """Number of elements of a 1-D value (for shape tensors), when it is static."""
    if value is None:
        return None
    if value.shape is not None and value.shape.rank() == 1 and isinstance(value.shape[0], int):
        return value.shape[0]
    values = static_ints(value)
    return None if values is None else len(values)


def last_element(value: ir.Value | None) -> int | None:
    """The last entry of a 1-D int tensor, when it is static even if the others are not."""
    if value is None:
        return None
    values = static_ints(value)
    if values is not None:
        return values[-1] if values else None
    node = value.producer()
    if node is not None and node.op_type == "Concat" and node.inputs:
        return last_element(node.inputs[-1])
    return None


def normalize_axis(axis: int, rank: int) -> int | None:
    if not -rank <= axis < rank:
        return None
    return axis % rank
