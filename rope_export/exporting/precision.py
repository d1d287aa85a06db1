"""Half-precision files that state PyTorch's float32 steps, so that every runner computes them in float32.

In a float16/bfloat16 model transformers computes a few steps in float32, and trained weights need
them (massive activations of hundreds to thousands square past float16's 65504; attention logits of
tens make a float16 softmax round its terms to a few bits):

* **softmax**: eager attention calls ``softmax(scores, dtype=torch.float32)``, which PyTorch defines
  as casting the input first. onnxscript's torchlib (0.7) translates ``aten::softmax.int`` and
  ``aten::log_softmax.int`` as Softmax in the input's type and a Cast of the result, and its optimizer
  then drops the Cast pair: the file computed the softmax in float16. ``TRANSLATIONS`` casts first.
* **norm statistics**: transformers' RMSNorm casts to float32, normalizes, casts back and multiplies by
  its weight. torch.onnx fuses that to ``RMSNormalization(x16, w16, stash_type=1)``, which states the
  same computation, but a runner may ignore ``stash_type`` (onnx.reference 1.23 squares x in float16:
  measured, it overflows on massive activations). ``state_norm_precision`` writes the spec's own
  function body with its float32 in the types: Cast(x, float32) -> the norm in float32 with a unit
  scale -> Cast back -> Mul by the weight (Add the bias): the same value, and no runner can skip it.

Everything else (weights, matmuls, the residual stream) stays in the file's dtype. Rotations compute
in float32 by the op contract, with the caches in the dtype the model keeps them in.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
NORMS = ("RMSNormalization", "LayerNormalization")
MARK = "rope_export.float32_step"  # metadata on the nodes this module writes: what they state, for check and tests


def _softmax_translation(op_type: str):
    def translate(self, dim: int, dtype=None):
        from onnxscript import opset18 as op

        scalar = self.shape is not None and len(self.shape) == 0
        if dtype is not None and dtype != -1:  # PyTorch: the input is cast to dtype, then the softmax computed
            self = op.Cast(self, to=dtype)
        if scalar:
            self = op.Unsqueeze(self, op.Constant(value_ints=[0]))
        result = getattr(op, op_type)(self, axis=dim)
        return op.Squeeze(result) if scalar else result

    return translate


def translations() -> dict:
    """torch.onnx translations that keep PyTorch's softmax precision (module doc)."""
    import torch

    return {torch.ops.aten.softmax.int: _softmax_translation("Softmax"),
            torch.ops.aten.log_softmax.int: _softmax_translation("LogSoftmax")}


def _ones(graph: ir.Graph, like: ir.Value) -> ir.Value:
    """A float32 initializer of ones shaped like the scale (one element where its shape is unknown), shared."""
    dims = like.shape.dims if like.shape is not None and all(isinstance(d, int) for d in like.shape.dims) else (1,)
    name = f"rope_export.ones_float32_{'x'.join(map(str, dims)) or 'scalar'}"
    if name not in graph.initializers:
        value = ir.Value(name=name, const_value=ir.tensor(np.ones(dims, np.float32), name=name),
                         type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(dims))
        graph.register_initializer(value)
    return graph.initializers[name]


def _stated(node: ir.Node) -> list[ir.Node]:
    """The nodes that replace ``node`` (a norm on a half-precision input with float32 statistics)."""
    x, scale, *rest = node.inputs
    bias = rest[0] if rest else None
    half = x.dtype
    meta = {**node.metadata_props, MARK: f"{node.op_type} statistics in float32 (transformers upcasts)"}
    name = node.name or node.op_type
    up = ir.Node("", "Cast", [x], {"to": ir.AttrInt64("to", ir.DataType.FLOAT)}, name=f"{name}.to_float32",
                 metadata_props=dict(meta))
    up.outputs[0].dtype = ir.DataType.FLOAT
    attributes = {k: v for k, v in node.attributes.items()}
    norm = ir.Node("", node.op_type, [up.outputs[0], _ones(node.graph, scale)], attributes, name=f"{name}.float32",
                   metadata_props=dict(meta))
    norm.outputs[0].dtype = ir.DataType.FLOAT
    down = ir.Node("", "Cast", [norm.outputs[0]], {"to": ir.AttrInt64("to", half)}, name=f"{name}.to_half",
                   metadata_props=dict(meta))
    down.outputs[0].dtype = half
    scaled = ir.Node("", "Mul", [down.outputs[0], scale], name=f"{name}.scale", metadata_props=dict(meta))
    nodes = [up, norm, down, scaled]
    if bias is not None:
        nodes.append(ir.Node("", "Add", [scaled.outputs[0], bias], name=f"{name}.bias", metadata_props=dict(meta)))
    return nodes


def state_norm_precision(model: ir.Model) -> int:
    """Rewrite, in place, each RMSNormalization/LayerNormalization whose input is float16/bfloat16 and whose
    statistics are float32 (``stash_type`` 1, the default) into the explicit form of the module doc; a node
    whose Mean/InvStdDev outputs are used is left alone. Returns how many were rewritten."""
    rewritten = 0
    for graph in (model.graph, *model.graph.subgraphs()):
        for node in list(graph):
            if node.domain not in ("", "ai.onnx") or node.op_type not in NORMS or len(node.inputs) < 2:
                continue
            stash = node.attributes.get("stash_type")
            if node.inputs[0].dtype not in HALF or (stash is not None and stash.as_int() != 1):
                continue
            if any(out.uses() for out in node.outputs[1:]):
                continue
            nodes = _stated(node)
            graph.insert_before(node, nodes)
            old = node.outputs[0]
            new = nodes[-1].outputs[0]
            new.shape, new.dtype, name = old.shape, old.dtype, old.name
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            new.name = name  # the value keeps its name: later edits (dims, outputs) find it
            rewritten += 1
    return rewritten
