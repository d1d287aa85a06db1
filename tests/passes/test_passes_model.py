"""Plumbing of the passes: accepted model kinds, loading and atomic saving, the value helpers."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from onnx import helper
from passes_util import rotary_case

from rope_export.passes import PassError, load_model, lower, save_model
from rope_export.passes._model import onnx_opset
from rope_export.passes._values import static_ints


def test_paths_are_accepted(tmp_path):
    model, _, _ = rotary_case()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    lowered = lower(path, "decomposed")
    assert isinstance(lowered, onnx.ModelProto)


def test_wrong_kinds_and_files_are_named():
    with pytest.raises(TypeError, match="expected an onnx.ModelProto, an onnx_ir.Model or a path"):
        lower(42, "onnx")
    with pytest.raises(FileNotFoundError, match="no such ONNX file"):
        load_model("/nonexistent/model.onnx")


def test_save_is_atomic_and_leaves_nothing_behind(tmp_path, monkeypatch):
    model, _, _ = rotary_case()
    path = tmp_path / "m.onnx"
    save_model(model, path)
    assert onnx.load(path) == model
    original = path.read_bytes()

    def boom(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("pathlib.Path.write_bytes", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, path)
    monkeypatch.undo()
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        save_model(model, tmp_path / "no" / "m.onnx")


def test_two_ai_onnx_imports_are_rejected():
    model, _, _ = rotary_case()
    model.opset_import.append(helper.make_opsetid("ai.onnx", 18))
    with pytest.raises(PassError, match="imports two ai.onnx opsets"):
        onnx_opset(ir.from_proto(model))


def test_static_ints_resolves_torchscript_shape_arithmetic():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "h", "s", 16])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Constant", [], ["three"], value=helper.make_tensor("t", onnx.TensorProto.INT64, [], [3])),
        helper.make_node("Gather", ["shape", "three"], ["d"], axis=0),
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", onnx.TensorProto.INT64, [], [2])),
        helper.make_node("Div", ["d", "two"], ["half"]),
        helper.make_node("Cast", ["half"], ["half64"], to=onnx.TensorProto.INT64),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("t", onnx.TensorProto.INT64, [1], [0])),
        helper.make_node("Unsqueeze", ["half64", "zero"], ["end"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
    ]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("end", onnx.TensorProto.INT64, None),
                                                  helper.make_tensor_value_info("batch", onnx.TensorProto.INT64, None)])
    model = ir.from_proto(helper.make_model(graph))
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert static_ints(values["end"]) == [8]
    assert static_ints(values["batch"]) is None  # symbolic
    known = {model.graph.inputs[0]: [None, None, None, 10]}
    assert static_ints(values["end"], known) == [5]
    assert static_ints(values["shape"]) is None  # b, h, s are symbolic
