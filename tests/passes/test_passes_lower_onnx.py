"""Target onnx: ai.onnx RotaryEmbedding-23, guarded positions, opset handling, half types."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from passes_util import ops_of, rotary_case, run_ort, run_reference

from rope_export.op.tolerances import tolerance
from rope_export.passes import LoweringLog, PassError, lower
from rope_export.passes._model import bump_onnx_opset


def _opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def test_standard_op_with_opset_23_runs_in_float32_under_float32_caches():
    model, feeds, expected = rotary_case(x_dtype="float16", cache_dtype="float32", opset=17)
    lowered = lower(model, "onnx")
    assert _opset(lowered) == 23
    assert model.ir_version == 10 and lowered.ir_version == 11  # opset 23 needs IR version 11
    (rope,) = [n for n in lowered.graph.node if n.op_type == "RotaryEmbedding"]
    assert rope.domain == "" and rope.name == "rope_q"
    assert len(rope.input) == 3  # guarded: per-token caches, no position_ids
    # The contract's float32 math: X is cast up, the float32 caches stay, the result is cast back.
    producers = {out: n for n in lowered.graph.node for out in n.output}
    to = lambda node: helper.get_attribute_value(node.attribute[0])  # noqa: E731
    assert producers[rope.input[0]].op_type == "Cast" and to(producers[rope.input[0]]) == onnx.TensorProto.FLOAT
    (after,) = [n for n in lowered.graph.node if rope.output[0] in n.input]
    assert after.op_type == "Cast" and to(after) == onnx.TensorProto.FLOAT16
    assert not any(n.op_type == "Cast" and n.input[0] in ("cos", "sin") for n in lowered.graph.node)
    assert tolerance("op", "float16").allclose(run_ort(lowered, feeds)[0], expected)


def test_half_caches_keep_the_op_in_half_precision():
    model, feeds, expected = rotary_case(x_dtype="float16", cache_dtype="float16")
    lowered = lower(model, "onnx")
    assert not any(n.op_type == "Cast" for n in lowered.graph.node)
    assert tolerance("op", "float16").allclose(run_ort(lowered, feeds)[0], expected)


def test_out_of_range_positions_pass_through_when_guarded_and_fail_when_trusted():
    model, feeds, expected = rotary_case(seed=11, max_pos=6, seq=6)  # positions in [-2, 8)
    bad = (feeds["pos"] < 0) | (feeds["pos"] >= 6)
    assert bad.any()
    guarded = run_ort(lower(model, "onnx"), feeds)[0]
    assert tolerance("op", "float32").allclose(guarded, expected)
    b, s = np.nonzero(bad)
    np.testing.assert_array_equal(guarded[b, :, s], feeds["x"][b, :, s])  # identity rotation

    trusted = lower(model, "onnx", guard_positions=False)
    (rope,) = [n for n in trusted.graph.node if n.op_type == "RotaryEmbedding"]
    assert list(rope.input)[3] == "pos"
    with pytest.raises(Exception, match="out of range"):
        run_ort(trusted, feeds)
    in_range = dict(feeds, pos=np.clip(feeds["pos"], 0, 5))
    assert tolerance("op", "float32").allclose(run_ort(trusted, in_range)[0], run_reference(model, in_range)[0])


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_bfloat16_is_expressible_and_says_where_it_runs(cache_dtype):
    model, feeds, expected = rotary_case(x_dtype="bfloat16", cache_dtype=cache_dtype)
    log = LoweringLog()
    lowered = lower(model, "onnx", log=log)
    # With float32 caches the op runs in float32 (onnxruntime CPU has that kernel); with bf16
    # caches it runs in bf16, which onnxruntime's CPU provider lacks, and the log says so.
    noted = any("RotaryEmbedding-23" in n and "no kernel" in n for n in log.notes)
    assert noted == (cache_dtype == "bfloat16")
    assert any("bfloat16 X" in n and "onnxruntime's CPU provider" in n for n in log.notes)  # the Where
    assert tolerance("op", "bfloat16").allclose(run_reference(lowered, feeds)[0].astype(np.float32),
                                                expected.astype(np.float32))


def _graph(opset: int, nodes, inits=()):
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    g = helper.make_graph(nodes, "g", [x], [y], initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_opset_bump_only_relabels_when_no_op_changed():
    import onnx_ir as ir

    model = _graph(17, [helper.make_node("Relu", ["x"], ["y"])])  # Relu-14 is current at 23
    bumped = ir.to_proto(bump_onnx_opset(ir.from_proto(model), 23))
    assert _opset(bumped) == 23 and [n.op_type for n in bumped.graph.node] == ["Relu"]


def test_opset_bump_converts_changed_ops():
    import onnx_ir as ir

    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    del axes
    model = _graph(17, [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)])  # axes attr -> input at 18
    bumped = ir.to_proto(bump_onnx_opset(ir.from_proto(model), 23))
    onnx.checker.check_model(bumped, full_check=True)
    (node,) = [n for n in bumped.graph.node if n.op_type == "ReduceMean"]
    assert len(node.input) == 2  # the converter moved axes to an input
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(run_ort(bumped, {"x": x})[0], x.mean(axis=1))


def test_opset_bump_failure_names_the_ops_and_other_targets(monkeypatch):
    import onnx_ir as ir

    model = _graph(17, [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1])])

    def broken(*args, **kwargs):
        raise RuntimeError("adapter missing")

    monkeypatch.setattr(onnx.version_converter, "convert_version", broken)
    with pytest.raises(PassError, match=r"ops \['ReduceMean'\] changed .* \(ort, decomposed\)"):
        bump_onnx_opset(ir.from_proto(model), 23)


def test_other_nodes_survive_the_conversion():
    model, feeds, expected = rotary_case(multi_node=True, opset=18, seed=2)
    lowered = lower(model, "onnx")
    assert {"MatMul", "Add", "RotaryEmbedding"} <= {op for _, op in ops_of(lowered)}
    assert tolerance("op", "float32").allclose(run_ort(lowered, feeds)[0], expected)
