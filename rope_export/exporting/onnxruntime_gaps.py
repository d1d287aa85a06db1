"""Ops torch.onnx writes that onnxruntime's CPU kernels (1.32) refuse, rewritten to the same values.

Each rewrite keeps what the graph computes by the ONNX spec, so every runtime computes what it did; it only
lets onnxruntime run the file (``export_module`` checks every file on it before writing it):

* ``expand_query_axis``: torch.onnx writes ``scaled_dot_product_attention`` as ``ai.onnx`` Attention-23 at
  opset 23, whose ``attn_mask`` is "broadcastable to (batch, heads, q_sequence_length, total_sequence_length)";
  diffusers passes a caption mask with one row for every query (``[B, H, 1, T]``: LTX-Video, HunyuanVideo),
  which onnxruntime's CPU kernel refuses ("inconsistent q_sequence_length (between attn_mask and Q)"); an
  ``Expand`` to the query length goes in front of each such mask;
* ``where_on_bool``: ``masked_fill`` of a boolean tensor is a ``Where`` of booleans, which onnxruntime has no
  kernel for (HunyuanVideo's attention mask); it is computed on uint8 between two Casts.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

MASK_INPUT = 3  # Attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen)


def _ints(graph: ir.Graph, before: ir.Node, values: list[int], name: str) -> ir.Value:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(values, dtype=np.int64))},
                   name=name)
    graph.insert_before(before, node)
    return node.outputs[0]


def expand_query_axis(model: ir.Model) -> int:
    """Expand the query axis of every Attention mask that has it of size 1 to the query length; the number
    expanded."""
    graph = model.graph
    expanded = 0
    for node in list(graph):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.inputs) <= MASK_INPUT:
            continue
        mask, query = node.inputs[MASK_INPUT], node.inputs[0]
        if mask is None or mask.shape is None or query.shape is None or mask.shape.rank() < 2:
            continue
        seq_axis = 2 if query.shape.rank() == 4 else 1
        if mask.shape[-2] != 1 or query.shape.rank() not in (3, 4) or query.shape[seq_axis] == 1:
            continue
        prefix = f"{node.name or 'attention'}/mask_rows"
        mask_shape = ir.node("Shape", [mask], name=f"{prefix}/mask_shape")
        query_shape = ir.node("Shape", [query], attributes={"start": seq_axis, "end": seq_axis + 1},
                              name=f"{prefix}/query_length")
        for made in (mask_shape, query_shape):
            graph.insert_before(node, made)
        head = ir.node("Slice", [mask_shape.outputs[0], _ints(graph, node, [0], f"{prefix}/zero"),
                                 _ints(graph, node, [mask.shape.rank() - 2], f"{prefix}/rank")],
                       name=f"{prefix}/batch_heads")
        graph.insert_before(node, head)
        last = ir.node("Slice", [mask_shape.outputs[0], _ints(graph, node, [-1], f"{prefix}/minus_one"),
                                 _ints(graph, node, [mask.shape.rank()], f"{prefix}/end")], name=f"{prefix}/keys")
        graph.insert_before(node, last)
        shape = ir.node("Concat", [head.outputs[0], query_shape.outputs[0], last.outputs[0]], attributes={"axis": 0},
                        name=f"{prefix}/shape")
        graph.insert_before(node, shape)
        expand = ir.node("Expand", [mask, shape.outputs[0]], name=f"{prefix}/expand")
        graph.insert_before(node, expand)
        out = expand.outputs[0]
        out.dtype = mask.dtype
        out.shape = ir.Shape([*mask.shape[:-2], query.shape[seq_axis], mask.shape[-1]])
        node.replace_input_with(MASK_INPUT, out)
        expanded += 1
    return expanded


def where_on_bool(model: ir.Model) -> int:
    """Compute every ``Where`` of boolean values on uint8 (Cast, Where, Cast back); the number rewritten."""
    graph = model.graph
    rewritten = 0
    for node in list(graph):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or node.outputs[0].dtype != ir.DataType.BOOL:
            continue
        prefix = f"{node.name or 'where'}/uint8"
        for index in (1, 2):
            cast = ir.node("Cast", [node.inputs[index]], attributes={"to": ir.DataType.UINT8}, name=f"{prefix}/{index}")
            graph.insert_before(node, cast)
            cast.outputs[0].dtype = ir.DataType.UINT8
            cast.outputs[0].shape = node.inputs[index].shape
            node.replace_input_with(index, cast.outputs[0])
        out = node.outputs[0]
        back = ir.node("Cast", [out], attributes={"to": ir.DataType.BOOL}, name=f"{prefix}/back")
        graph.insert_after(node, back)
        result = back.outputs[0]
        result.dtype, result.shape = ir.DataType.BOOL, out.shape
        out.replace_all_uses_with(result)  # also the graph's outputs
        back.replace_input_with(0, out)
        out.dtype = ir.DataType.UINT8
        rewritten += 1
    return rewritten


def fill_onnxruntime_gaps(model: ir.Model) -> list[str]:
    """Every rewrite of this module on ``model``; a note for each that changed it."""
    notes = []
    for rewrite, what in ((expand_query_axis, "attention mask(s) expanded along the queries"),
                          (where_on_bool, "Where of booleans computed on uint8")):
        count = rewrite(model)
        if count:
            notes.append(f"{count} {what} (onnxruntime's CPU kernels refuse them as torch.onnx writes them; same "
                         "values by the ONNX spec)")
    return notes
