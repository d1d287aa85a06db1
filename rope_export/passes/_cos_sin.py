"""Where the cos/sin of a decomposed RoPE come from, and how to hand them to the fused op.

A decomposed site computes ``x * C + rot(x) * S`` with full-width C, S ([.., rd]) broadcast over
the heads. It equals rope_export::RotaryEmbedding only if each frequency appears twice in C and S:
``C = cat(c, c)`` for rotate-half, ``C = repeat_interleave(c, 2)`` for interleaved. ``trace``
follows C back through the steps exporters leave (Unsqueeze for the head axis, unary element-wise
ops such as Cos/Sin/Cast/Mul-by-a-scalar, the duplication itself) to its source:

* ``gather``: ``Gather(cache, position_ids)`` of a constant ``[max_pos, w]`` table -> the fused op
  gets a ``[max_pos, rd/2]`` initializer (element-wise steps folded in) plus position_ids;
* ``per-token``: anything computed in the graph (``position_ids * inv_freq`` and the like) -> the
  element-wise steps are re-applied to the half-width value, giving ``[B, S, rd/2]`` caches and
  no position_ids.

The duplication must be proven: by the graph (a Concat of one value with itself, a
repeat_interleave block) or numerically for constant tables.

Spellings this structural trace does not follow (a stacked ``[max_pos, d, 2]`` table read with a
select, cos/sin sliced and re-interleaved after an Unsqueeze, einops' repeat, a trailing pair axis)
are handled by two generic sources, found by evaluating the graph (``_probe``):

* ``table_traces``: cos/sin read from one constant table by computed indices (Gather/GatherND):
  the ``[max_pos, rd/2]`` tables are the cos/sin path evaluated for every row, the indices become
  the op's position ids;
* ``graph_trace`` (kind ``graph``): anything else computed per token: the cos/sin values as the
  site uses them, reduced in the graph to ``[B, S, rd/2]`` (head 0, first channel of each pair).

Every source is checked afterwards by running the site against the op contract (``_verify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from rope_export.passes._probe import Probe, ProbeError
from rope_export.passes._site import Form, tokens_of
from rope_export.passes._values import (
    INT64_MAX,
    const_array,
    dim,
    last_element,
    rank_of,
    same_dim,
    static_ints,
    static_length,
)

UNARY = {"Cos", "Sin", "Cast", "Identity", "Neg"}
BINARY_SCALAR = {"Mul", "Div", "Add", "Sub"}


class TraceError(Exception):
    pass


@dataclass
class Trace:
    """Result of following one of C/S back to its source."""

    kind: str  # "gather", "per-token" or "graph"
    head_axis: int  # axis of the 4-D x that C broadcasts over (1: [B, H, S, D], 2: [B, S, H, D])
    seq_axis: int
    base: ir.Value | None = None  # per-token: the half-width value the element-wise steps start from
    base_has_batch: bool = True  # per-token: base is [B, S, w] (else [S, w])
    steps: list[tuple[ir.Node, int]] = field(default_factory=list)  # element-wise (node, input index)
    table: np.ndarray | None = None  # gather: [max_pos, rd/2] after the element-wise steps
    positions: ir.Value | None = None  # gather: the index input
    product: ir.Value | None = None  # graph: a product with this value (its shape: the value broadcast)
    constant: bool = False  # graph: the value is a constant (a table folded for the traced length)

    @property
    def source(self) -> str:
        if self.constant:
            return "a constant table of the traced length"
        return {"gather": "Gather(cache, position_ids)", "graph": "as the site computes them"}.get(
            self.kind, "computed in the graph")


def _unsqueeze_axes(node: ir.Node) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return static_ints(node.inputs[1])
    attr = node.attributes.get("axes")
    return list(attr.as_ints()) if attr is not None else None


def _scalar_operand(node: ir.Node) -> int | None:
    """For Mul/Div/Add/Sub with one single-element constant operand: the index of the other input."""
    if len(node.inputs) != 2:
        return None
    for i in (0, 1):
        arr = const_array(node.inputs[1 - i])
        if arr is not None and arr.size == 1:
            return i
    return None


def _repeat_interleave_source(node: ir.Node) -> tuple[ir.Value, list[int]] | None:
    """``Reshape(Expand|Tile(Unsqueeze(v, [.., last]), [1, .., 1, 2]), [.., -1])`` -> (v, other axes).

    That is ``repeat_interleave(v, 2, dim=-1)`` as torch.onnx writes it (dynamo: Expand,
    TorchScript: Tile). The returned axes are the other axes that the same Unsqueeze inserted (the
    TorchScript exporter merges ``sin[:, :, None, :]`` into it).
    """
    if node.op_type != "Reshape" or len(node.inputs) < 2:
        return None
    rep = node.inputs[0].producer() if node.inputs[0] is not None else None
    if rep is None or rep.op_type not in ("Expand", "Tile") or len(rep.inputs) != 2:
        return None
    counts = static_ints(rep.inputs[1])
    if counts is None or not counts or counts[-1] != 2 or any(c != 1 for c in counts[:-1]):
        return None
    unsq = rep.inputs[0].producer() if rep.inputs[0] is not None else None
    if unsq is None or unsq.op_type != "Unsqueeze":
        return None
    axes = _unsqueeze_axes(unsq)
    out_rank = rank_of(unsq.outputs[0])
    if axes is None or out_rank is None or len(counts) != out_rank:
        return None
    axes = sorted(a % out_rank for a in axes)
    if axes[-1] != out_rank - 1:
        return None
    # the Reshape must merge the last two axes: one fewer entry, ending in -1 or the merged width
    length, last = static_length(node.inputs[1]), last_element(node.inputs[1])
    width = dim(unsq.inputs[0], -1)
    if length != out_rank - 1 or last not in (-1, None if width is None else 2 * width):
        return None
    return unsq.inputs[0], axes[:-1]


def _numeric_step(table: np.ndarray, node: ir.Node, index: int) -> np.ndarray:
    op = node.op_type
    if op == "Cos":
        return np.cos(table)
    if op == "Sin":
        return np.sin(table)
    if op == "Neg":
        return -table
    if op == "Identity":
        return table
    if op == "Cast":
        return table.astype(ir.DataType(node.attributes["to"].as_int()).numpy())
    other = const_array(node.inputs[1 - index]).astype(table.dtype)
    a, b = (table, other) if index == 0 else (other, table)
    return {"Mul": np.multiply, "Div": np.divide, "Add": np.add, "Sub": np.subtract}[op](a, b).astype(table.dtype)


def _duplicated(table: np.ndarray, interleaved: bool) -> np.ndarray | None:
    """The half-width table if the last axis repeats each column twice in the mode's layout."""
    width = table.shape[-1]
    if width % 2:
        return None
    if interleaved:
        first, second = table[..., 0::2], table[..., 1::2]
    else:
        first, second = table[..., : width // 2], table[..., width // 2 :]
    return np.ascontiguousarray(first) if np.array_equal(first, second) else None


def _gathered_positions(node: ir.Node) -> tuple[np.ndarray, ir.Value] | None:
    """(table, position ids) when ``node`` reads rows of a constant 2-D table by position ids.

    ``Gather(table, pos, axis=0)`` (TorchScript, most exporters) or
    ``GatherND(table, Unsqueeze(pos, -1))`` (torch's dynamo exporter for ``table[pos]``).
    """
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Gather", "GatherND"):
        return None
    table = const_array(node.inputs[0])
    if table is None or table.ndim != 2:
        return None
    if node.op_type == "Gather":
        axis = node.attributes.get("axis")
        if axis is not None and axis.as_int() != 0:
            return None
        pos = node.inputs[1]
    else:
        batch_dims = node.attributes.get("batch_dims")
        if batch_dims is not None and batch_dims.as_int() != 0:
            return None
        unsq = node.inputs[1].producer()
        if unsq is None or unsq.op_type != "Unsqueeze" or dim(node.inputs[1], -1) != 1:
            return None
        axes = _unsqueeze_axes(unsq)
        out_rank = rank_of(node.inputs[1])
        if axes is None or out_rank is None or [a % out_rank for a in axes] != [out_rank - 1]:
            return None
        pos = unsq.inputs[0]
    if rank_of(pos) not in (1, 2):
        return None
    return table, pos


def trace(value: ir.Value, dup: str | None, rd: int) -> Trace:
    """Follow C (or S) back to its source; raise TraceError with the reason when it is not RoPE-shaped.

    ``dup``: how the full-width C repeats each frequency, "cat" (rotate-half), "repeat"
    (interleaved), or None when C is already half-width (the explicit pairs form).
    """
    interleaved = dup == "repeat"
    name = {"repeat": "repeat_interleave(c, 2)", "cat": "cat(c, c)"}.get(dup, "")
    base, steps, inserted, duplicated = _walk_back(value, dup)

    # The source: a Gather of a constant table by position ids, or anything else (per token).
    table = positions = None
    producer = base.producer()
    if producer is not None and _gathered_positions(producer) is not None:
        table, positions = _gathered_positions(producer)
    if table is not None:
        base_rank = rank_of(positions) + 1
    else:
        base_rank = rank_of(base)
        if base_rank is None:
            raise TraceError("the rank of the cos/sin source is unknown (run shape inference)")
    head_axis, seq_axis = _head_and_seq_axes(base_rank, inserted)

    if table is not None:
        if dup is not None and not duplicated:
            half = _duplicated(table, interleaved)
            if half is None:
                raise TraceError(f"the constant cos/sin table is not {name} along its last axis")
            table = half
        if table.shape[-1] != rd // 2:
            raise TraceError(f"the cos/sin table is {table.shape[-1]} wide per pair, the rotation needs {rd // 2}")
        for node, index in steps:
            table = _numeric_step(table, node, index)
        return Trace("gather", head_axis, seq_axis, table=table, positions=positions)

    if dup is not None and not duplicated:
        if const_array(base) is None:
            raise TraceError(f"cannot show that cos/sin repeat each frequency twice as {name}")
        raise TraceError("cos/sin are constants that do not depend on positions; not fused")
    width = dim(base, -1)
    if width is not None and width != rd // 2:
        raise TraceError(f"cos/sin carry {width} frequencies, the rotated part needs {rd // 2}")
    return Trace("per-token", head_axis, seq_axis, base=base, base_has_batch=base_rank == 3, steps=steps)


def _walk_back(value: ir.Value, dup: str | None):
    """(the source, the elementwise steps in application order, the Unsqueeze axes outermost first, whether the
    duplication of each frequency was passed): C followed back through Unsqueezes, unary and scalar steps."""
    inserted: list[list[int]] = []  # Unsqueeze axes, outermost first
    steps: list[tuple[ir.Node, int]] = []  # outermost first
    duplicated = False
    v = value
    for _ in range(64):
        node = v.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            break
        op = node.op_type
        if op == "Unsqueeze":
            axes = _unsqueeze_axes(node)
            out_rank = rank_of(node.outputs[0])
            if axes is None or out_rank is None:
                raise TraceError("an Unsqueeze on the cos/sin path has non-constant axes or an unknown rank")
            inserted.append(sorted(a % out_rank for a in axes))
            v = node.inputs[0]
        elif op in UNARY:
            steps.append((node, 0))
            v = node.inputs[0]
        elif op in BINARY_SCALAR and _scalar_operand(node) is not None:
            index = _scalar_operand(node)
            steps.append((node, index))
            v = node.inputs[index]
        elif dup == "cat" and op == "Concat" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
            axis = node.attributes.get("axis")
            rank = rank_of(node.outputs[0])
            if axis is None or rank is None or axis.as_int() % rank != rank - 1 or duplicated:
                break
            duplicated = True
            v = node.inputs[0]
        elif dup == "repeat" and not duplicated and _repeat_interleave_source(node) is not None:
            v, extra_axes = _repeat_interleave_source(node)
            duplicated = True
            if extra_axes:
                inserted.append(extra_axes)
        else:
            break
    steps.reverse()  # application order: from the base outwards
    return v, steps, inserted, duplicated


def _head_and_seq_axes(base_rank: int, inserted: list[list[int]]) -> tuple[int, int]:
    """Where the heads and the sequence are, re-applying the Unsqueezes to the source's labelled axes."""
    if base_rank not in (2, 3):
        raise TraceError(f"cos/sin come from a rank-{base_rank} value; expected per token [B, S, d] or [S, d]")
    labels = ["b", "s", "f"] if base_rank == 3 else ["s", "f"]
    for axes in reversed(inserted):
        for a in axes:
            if a > len(labels):
                raise TraceError("an Unsqueeze on the cos/sin path inserts an axis out of range")
            labels.insert(a, "1")
    if len(labels) != 4 or labels[3] != "f" or labels.count("s") != 1 or labels.index("s") not in (1, 2):
        raise TraceError(f"cos/sin broadcast as {labels}; expected [B, 1, S, d] or [B, S, 1, d]")
    seq_axis = labels.index("s")
    head_axis = 3 - seq_axis
    if labels[head_axis] != "1" or labels[0] not in ("b", "1"):
        raise TraceError(f"cos/sin broadcast as {labels}; expected [B, 1, S, d] or [B, S, 1, d]")
    return head_axis, seq_axis


def _const(op, values, dtype=np.int64) -> ir.Value:
    return op.Constant(value=ir.tensor(np.asarray(values, dtype=dtype)))


def _tokens_shape(op, x: ir.Value, seq_axis: int) -> ir.Value:
    """[B, S] of the rotated tensor (as a 1-D int64 shape)."""
    shape = op.Shape(x)
    return op.Concat(
        op.Slice(shape, _const(op, [0]), _const(op, [1]), _const(op, [0])),
        op.Slice(shape, _const(op, [seq_axis]), _const(op, [seq_axis + 1]), _const(op, [0])),
        axis=0,
    )


def per_token_value(op, tr: Trace, x: ir.Value, half: int) -> ir.Value:
    """Build the [B, S, rd/2] cache for a per-token trace (re-applying its element-wise steps)."""
    v = tr.base
    for node, index in tr.steps:
        inputs = list(node.inputs)
        inputs[index] = v
        v = op.op(node.op_type, *inputs, **dict(node.attributes))
    if not tr.base_has_batch:
        v = op.Unsqueeze(v, _const(op, [0]))
    if not (tr.base_has_batch and same_dim(tr.base, 0, x, 0) and same_dim(tr.base, 1, x, tr.seq_axis)):
        target = op.Concat(_tokens_shape(op, x, tr.seq_axis), _const(op, [half]), axis=0)
        v = op.Expand(v, target)
    return v


def gather_inputs(op, tr: Trace, x: ir.Value, name: str) -> tuple[ir.Value, ir.Value]:
    """(table initializer, [B, S] int64 position ids) for a gather trace."""
    table = op.initializer(ir.tensor(tr.table), name=name)
    pos = tr.positions
    if pos.dtype != ir.DataType.INT64:
        pos = op.Cast(pos, to=ir.DataType.INT64)
    has_batch = rank_of(tr.positions) == 2
    if not has_batch:
        pos = op.Unsqueeze(pos, _const(op, [0]))
    if not (has_batch and same_dim(tr.positions, 0, x, 0) and same_dim(tr.positions, 1, x, tr.seq_axis)):
        pos = op.Expand(pos, _tokens_shape(op, x, tr.seq_axis))
    return table, pos


# -- generic sources ---------------------------------------------------------------------------------

def _walk_up(value: ir.Value, limit: int, visit) -> bool:
    """Visit the nodes ``value`` is computed from, depth first; ``visit(node)`` returns True to stop below that
    node. Returns whether the walk gave up at ``limit`` values (the graph may go on)."""
    stack, seen = [value], set()
    while stack and len(seen) < limit:
        v = stack.pop()
        if v is None or v in seen:
            continue
        seen.add(v)
        node = v.producer()
        if node is not None and not visit(node):
            stack.extend(node.inputs)
    return len(seen) >= limit


def _table_gathers(value: ir.Value) -> list[tuple[np.ndarray, ir.Value]]:
    """(constant table, index value) of every Gather/GatherND of a constant table on value's path."""
    found = []

    def gather(node: ir.Node) -> bool:
        if node.op_type in ("Gather", "GatherND") and node.domain in ("", "ai.onnx"):
            table = const_array(node.inputs[0])
            gathered = _gathered_index(node) if table is not None and table.ndim >= 2 else None
            if gathered is not None:
                found.append((table, gathered))
                return True
        return False

    _walk_up(value, 200, gather)
    return found


def _gathered_index(node: ir.Node) -> ir.Value | None:
    if node.op_type == "Gather":
        axis = node.attributes.get("axis")
        return node.inputs[1] if axis is None or axis.as_int() == 0 else None
    batch_dims = node.attributes.get("batch_dims")
    unsq = node.inputs[1].producer()
    if (batch_dims is not None and batch_dims.as_int() != 0) or unsq is None or unsq.op_type != "Unsqueeze" \
            or dim(node.inputs[1], -1) != 1:
        return None
    return unsq.inputs[0]


def table_traces(probe: Probe, cos: ir.Value, sin: ir.Value, rank: int, layout: str, form: Form,
                 pairs: bool) -> tuple[Trace, Trace] | None:
    """cos and sin as ``[rows, rd/2]`` tables read by one index value, or None."""
    head_axis = 1 if layout == "bhsd" else 2
    for table, index in _table_gathers(cos):
        rows, symbols = table.shape[0], probe.symbols(index)
        if len(symbols) not in (1, 2) or symbols[-1] is None:
            continue
        sizes = {symbols[-1]: rows}
        if len(symbols) == 2:
            if symbols[0] is None and dim(index, 0) != 1:
                continue
            if symbols[0] is not None:
                sizes[symbols[0]] = 1
        at_rows = probe.with_sizes(sizes)
        shape = at_rows.shape(index)
        if shape is None or not dtype_is_int(index):
            continue
        feed = np.arange(rows).reshape(shape).astype(index.dtype.numpy())
        try:
            cos_all, sin_all = at_rows.run([cos, sin], {index: feed})
            cos_rows = tokens_of(cos_all, rank, layout, form, pairs)[0]
            sin_rows = tokens_of(sin_all, rank, layout, form, pairs)[0]
        except (ProbeError, ValueError, TypeError):
            continue
        return tuple(Trace("gather", head_axis, 3 - head_axis, table=np.ascontiguousarray(t), positions=index)
                     for t in (cos_rows, sin_rows))
    return None


def dtype_is_int(value: ir.Value) -> bool:
    return value.dtype in (ir.DataType.INT64, ir.DataType.INT32)


def graph_trace(probe: Probe, value: ir.Value, product: ir.Value, layout: str) -> Trace:
    """The cos (or sin) value as the site computes it.

    A constant (the exporter folded ``cache[:S]`` or ``cos(arange(S) * inv_freq)`` for the traced
    length) is a per-token cache all the same: the graph already holds one row per token of the
    traced sequence, which is all the original graph can run on too."""
    head_axis = 1 if layout == "bhsd" else 2
    try:
        probe.run([value], {})
    except ProbeError:
        return Trace("graph", head_axis, 3 - head_axis, base=value, product=product)
    # the probe answers Shape from the traced sizes: a table made from an input's length is computed, not folded
    return Trace("graph", head_axis, 3 - head_axis, base=value, product=product, constant=not _reads_shapes(value))


def _reads_shapes(value: ir.Value, limit: int = 2000) -> bool:
    """Whether ``value`` is computed from a Shape or Size of another value (the exporter's own constants
    are not); a graph too large to walk counts as reading shapes."""
    shapes = []

    def shape(node: ir.Node) -> bool:
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
            shapes.append(node)
            return True
        return False

    return _walk_up(value, limit, shape) or bool(shapes)


def graph_per_token_value(op, tr: Trace, form: Form, pairs: bool) -> ir.Value:
    """[B, S, rd/2] from the value the site multiplies by: broadcast without the heads, head 0."""
    shape = op.Shape(tr.product)
    head, seq = tr.head_axis, tr.seq_axis

    def part(start, end):
        return op.Slice(shape, _const(op, [start]), _const(op, [end]), _const(op, [0]))

    target = op.Concat(part(0, head), _const(op, [1]), part(head + 1, INT64_MAX), axis=0)
    tokens = op.Reshape(op.Expand(tr.base, target), op.Concat(part(0, 1), part(seq, seq + 1), _const(op, [-1]),
                                                              axis=0))
    if pairs:
        return tokens
    if form.interleaved:
        return op.Slice(tokens, _const(op, [0]), _const(op, [form.rd]), _const(op, [-1]), _const(op, [2]))
    return op.Slice(tokens, _const(op, [0]), _const(op, [form.rd // 2]), _const(op, [-1]))


def folded_per_token_value(op, tr: Trace, layout: str, form: Form, pairs: bool) -> ir.Value:
    """[B', S', rd/2] for a layout fused by reshaping X (``_site.FOLDED``), from the value the site
    multiplies by: "thd" [T, H, D] -> [1, T, rd/2] (head 0); "rows" -> one row per [.., M, D] row of X,
    [N, M, rd/2] (cos broadcast to the product first, so per-head values stay per head)."""
    shape = op.Shape(tr.product)
    rank = rank_of(tr.product)

    def part(start, end):
        return op.Slice(shape, _const(op, [start]), _const(op, [end]), _const(op, [0]))

    if layout == "thd":
        head0 = op.Expand(tr.base, op.Concat(part(0, 1), _const(op, [1]), part(2, 3), axis=0))
        tokens = op.Reshape(head0, op.Concat(_const(op, [1]), part(0, 1), _const(op, [-1]), axis=0))
    else:
        tokens = op.Reshape(op.Expand(tr.base, shape),
                            op.Concat(_const(op, [-1]), part(rank - 2, rank), axis=0))
    if pairs:  # already one value per pair
        out = op.Slice(tokens, _const(op, [0]), _const(op, [form.rd // 2]), _const(op, [-1]))
    elif form.interleaved:
        out = op.Slice(tokens, _const(op, [0]), _const(op, [form.rd]), _const(op, [-1]), _const(op, [2]))
    else:
        out = op.Slice(tokens, _const(op, [0]), _const(op, [form.rd // 2]), _const(op, [-1]))
    out.dtype = tokens.dtype = tr.base.dtype  # shape inference does not always reach past the Reshape
    return out
