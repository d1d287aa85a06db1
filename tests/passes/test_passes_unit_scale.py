"""``_unit_scale.drop_unit_scales``: a product times exactly 1.0 before a sum is bypassed (``x * 1`` is ``x``),
anything else is left as it is: another scale, a constant that would broadcast the product to a higher rank,
a Mul by one whose operand is not a product, or one that feeds no sum."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rope_export.passes._model import infer_shapes, to_ir
from rope_export.passes._unit_scale import drop_unit_scales


def model(scale: np.ndarray, inner: str = "Mul", consumer: str = "Add") -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node(inner, ["x", "c"], ["p"]), helper.make_node("Mul", ["p", "one"], ["q"]),
             helper.make_node(consumer, ["q", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x, c], [y], [numpy_helper.from_array(scale, "one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def dropped(proto: onnx.ModelProto) -> int:
    ir_model, _ = to_ir(proto)
    infer_shapes(ir_model)  # as fuse does first: the product's rank is known
    return drop_unit_scales(ir_model.graph)


def test_a_product_times_one_before_a_sum_is_bypassed():
    assert dropped(model(np.array(1.0, np.float32))) == 1
    assert dropped(model(np.ones((1, 1), np.float32))) == 1


@pytest.mark.parametrize("case", ["scale", "rank", "not-a-product", "no-sum", "type"])
def test_anything_else_is_left_alone(case):
    proto = {"scale": lambda: model(np.array(1.5, np.float32)),
             "rank": lambda: model(np.ones((1, 1, 1, 1), np.float32)),
             "not-a-product": lambda: model(np.array(1.0, np.float32), inner="Add"),
             "no-sum": lambda: model(np.array(1.0, np.float32), consumer="Max"),
             "type": lambda: model(np.array(1.0, np.float64))}[case]()
    assert dropped(proto) == 0
