"""Products multiplied by exactly one: ``Mul(Mul(x, cos), 1.0)``.

Code that scales both terms of a rotation by a factor that is 1 for plain RoPE (x-transformers'
``t * freqs.cos() * scale + rotate_half(t) * freqs.sin() * scale`` with ``scale = 1.``) leaves a Mul
by a constant 1.0 after each product in a TorchScript export (the dynamo exporter's optimizer folds
it). The fusion rules match a sum of two products, so such a site would look like a scaled rotation.

``drop_unit_scales(graph)`` rewires the consumers of such a Mul to its other input, only where
removing it is exact and changes nothing else: the constant is a single element equal to 1.0 of the
same float type, the other input has at least its rank (so the output has the input's shape and
type: ``x * 1`` is ``x`` bit for bit, NaN, inf and -0 included), that input is itself a Mul, and the
Mul by one feeds an Add or Sub (a rotation's sum). The Mul is left in place when its output is a
graph output; unused, it is removed with the other dead nodes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from rope_export.passes._values import const_array

SUMS = ("Add", "Sub")


def _is_one(value: ir.Value | None, other: ir.Value) -> bool:
    array = const_array(value)
    if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        return False
    if other.dtype is not None and value.dtype is not None and other.dtype != value.dtype:
        return False
    rank = other.shape.rank() if other.shape is not None else None
    return float(array.reshape(-1)[0]) == 1.0 and rank is not None and rank >= array.ndim


def drop_unit_scales(graph: ir.Graph) -> int:
    """Bypass ``Mul(product, 1.0)`` nodes that feed a sum; returns how many were bypassed."""
    dropped = 0
    for node in list(graph):
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        out = node.outputs[0]
        if out.is_graph_output() or not any(user.op_type in SUMS for user, _ in out.uses()):
            continue
        for i in (0, 1):
            other, scale = node.inputs[i], node.inputs[1 - i]
            producer = other.producer() if other is not None else None
            if producer is None or producer.op_type != "Mul" or not _is_one(scale, other):
                continue
            out.replace_all_uses_with(other)
            dropped += 1
            break
    return dropped
