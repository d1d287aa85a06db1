"""The site-analysis helpers the fusion rules share: probe sizes and evaluation (_probe), reading a
rotation's pairs and sign from its channel permutation, data movement (_site)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from rope_export.passes._probe import Probe, ProbeError
from rope_export.passes._site import SkipSite, _read_permutation, common_source, data_movement_leaves


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_sizes_are_distinct_and_expressions_are_evaluated():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [x],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "Min(64, seq)", 8])])
    probe = Probe(model, infer=False)
    batch, seq = probe.size(ir.SymbolicDim("batch")), probe.size(ir.SymbolicDim("seq"))
    assert batch != seq and batch > 1 and seq > 1
    assert probe.size(ir.SymbolicDim("Min(64, seq)")) == seq
    assert probe.size(ir.SymbolicDim("2*seq + batch")) == 2 * seq + batch
    assert probe.with_sizes({"seq": 40}).size(ir.SymbolicDim("Min(64, seq)")) == 40


def test_run_cuts_at_feeds_and_resolves_shapes_of_unfed_inputs():
    """y = Reshape(a, Shape(b)) * 2: ``b`` is never fed, its shape comes from the sizes."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "seq"])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [helper.make_node("Shape", ["b"], ["shape"]), helper.make_node("Reshape", ["a", "shape"], ["r"]),
             helper.make_node("Mul", ["r", "two"], ["y"])]
    model = _model(nodes, [a, b], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [two])
    probe = Probe(model, {"batch": 3, "seq": 5}, infer=False)
    y_value = next(n for n in model.graph if n.op_type == "Mul").outputs[0]
    a_value = model.graph.inputs[0]
    (y,) = probe.run([y_value], {a_value: np.arange(15, dtype=np.float32)})
    np.testing.assert_array_equal(y, np.arange(15, dtype=np.float32).reshape(3, 5) * 2)
    with pytest.raises(ProbeError, match="graph input 'a'"):
        probe.run([y_value], {})


def test_unified_sizes_a_patch_grid_from_the_reshape_that_cuts_it():
    """x [B, C, 2*h, 2*w] viewed as [B, C, H // 2, 2, W // 2, 2]: torch.export names the grid's axes with symbols of its
    own (s41, s62) and onnx's data propagation has no Div, so only the Reshape's target sizes them; sized alone they
    would not equal H // 2 and W // 2."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, "2*height_2", "2*width_2"])
    ints = {name: helper.make_tensor(name, TensorProto.INT64, [len(v)], v)
            for name, v in (("two", [2]), ("c4", [4]), ("axes2", [2]), ("axes3", [3]), ("zero", [0]),
                            ("one", [1]), ("three", [3]), ("four", [4]))}
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "one"], ["b"]),
             helper.make_node("Slice", ["shape", "axes2", "three"], ["h"]),
             helper.make_node("Slice", ["shape", "axes3", "four"], ["w"]),
             helper.make_node("Div", ["h", "two"], ["h2"]), helper.make_node("Div", ["w", "two"], ["w2"]),
             helper.make_node("Concat", ["b", "c4", "h2", "two", "w2", "two"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["patches"])]
    out = helper.make_tensor_value_info("patches", TensorProto.FLOAT, ["batch", 4, "s62", 2, "s41", 2])
    model = _model(nodes, [x], [out], ints.values())
    probe = Probe(model)
    probe.shape(model.graph.inputs[0])
    height, width = probe.size(ir.SymbolicDim("2*height_2")), probe.size(ir.SymbolicDim("2*width_2"))
    unified = probe.unified()
    assert (unified.sizes["s62"], unified.sizes["s41"]) == (height // 2, width // 2)


def _moved(perm, sign):
    return np.tile((np.asarray(perm) + 1) * np.asarray(sign), (3, 1)).astype(np.float64)


@pytest.mark.parametrize("perm,sign,interleaved,rd,sin_sign", [
    ([2, 3, 0, 1], [-1, -1, 1, 1], False, 4, 1),  # cat(-x2, x1)
    ([2, 3, 0, 1], [1, 1, -1, -1], False, 4, -1),  # cat(x2, -x1): rotation by -angle
    ([1, 0, 3, 2], [-1, 1, -1, 1], True, 4, 1),  # stack((-x[1::2], x[::2])).flatten
    ([1, 0, 2, 3, 4, 5], [-1, 1, 1, 1, 1, 1], False, 2, 1),  # two channels rotate, four pass through
])
def test_the_permutation_gives_pairs_width_and_sign(perm, sign, interleaved, rd, sin_sign):
    form = _read_permutation(_moved(perm, sign))
    assert (form.interleaved, form.rd, form.sin_sign) == (interleaved, rd, sin_sign)


@pytest.mark.parametrize("perm,sign,reason", [
    ([2, 3, 0, 1], [1, 1, 1, 1], "paired neither"),  # cat(x2, x1): no sign change, not a rotation
    ([1, 2, 3, 0], [-1, 1, 1, 1], "paired neither"),  # a 4-cycle
    ([0, 1, 3, 2], [1, 1, -1, 1], "not an even prefix"),  # the moving channels are not first
])
def test_permutations_that_are_not_rotations_are_refused(perm, sign, reason):
    with pytest.raises(SkipSite, match=reason):
        _read_permutation(_moved(perm, sign))


def test_channels_moving_between_tokens_are_refused():
    moved = _moved([2, 3, 0, 1], [-1, -1, 1, 1])
    moved[1] = moved[1][::-1]
    with pytest.raises(SkipSite, match="move between tokens"):
        _read_permutation(moved)


def test_data_movement_and_common_source():
    """r = Concat(Neg(Slice(x)), Slice(x)) is made of x alone; Mul is not data movement."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    consts = [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in
              (("zero", 0), ("two", 2), ("four", 4), ("axis", 1))]
    nodes = [helper.make_node("Slice", ["x", "zero", "two", "axis"], ["lo"]),
             helper.make_node("Slice", ["x", "two", "four", "axis"], ["hi"]),
             helper.make_node("Neg", ["hi"], ["neg"]),
             helper.make_node("Concat", ["neg", "lo"], ["r"], axis=1),
             helper.make_node("Mul", ["x", "x"], ["sq"])]
    model = _model(nodes, [x], [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)], consts)
    values = {o.name: o for n in model.graph for o in n.outputs}
    xv = model.graph.inputs[0]
    assert data_movement_leaves(values["r"], {xv}) == {xv}
    assert common_source([values["lo"], values["neg"]]) is xv
    assert data_movement_leaves(values["sq"], {xv}) == {values["sq"]}  # computed, not moved
