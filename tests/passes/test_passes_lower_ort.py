"""Target ort: com.microsoft RotaryEmbedding (inputs X, position_ids, cos, sin)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from passes_util import NP_TYPES, ONNX_TYPES, MsRotary, rotary_case, run_ort, run_reference

from rope_export.op.tolerances import tolerance
from rope_export.passes import LoweringLog, PassError, lower


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout,interleaved,rd,scalar_pos", [
    ("bhsd", 0, 0, False), ("bhsd", 1, 8, False), ("bsd", 0, 8, False), ("bsd", 1, 0, True),
])
def test_reference_kernel_matches_onnxruntime(dtype, layout, interleaved, rd, scalar_pos):
    """MsRotary (used for bfloat16, where onnxruntime CPU has no kernel) agrees with onnxruntime."""
    rng = np.random.default_rng(0)
    b, h, s, d, p = 2, 3, 4, 16, 10
    shape = [b, h, s, d] if layout == "bhsd" else [b, s, h * d]
    t = ONNX_TYPES[dtype]
    half = (rd or d) // 2
    inputs = [helper.make_tensor_value_info("x", t, shape),
              helper.make_tensor_value_info("pos", onnx.TensorProto.INT64, None),
              helper.make_tensor_value_info("c", t, [p, half]), helper.make_tensor_value_info("s", t, [p, half])]
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "c", "s"], ["y"], domain="com.microsoft",
                            interleaved=interleaved, num_heads=h, rotary_embedding_dim=rd)
    model = helper.make_model(helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", t, shape)]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    feeds = {"x": rng.standard_normal(shape).astype(NP_TYPES[dtype]),
             "pos": np.array([3], np.int64) if scalar_pos else rng.integers(0, p, (b, s)).astype(np.int64),
             "c": rng.uniform(-1, 1, (p, (rd or d) // 2)).astype(NP_TYPES[dtype]),
             "s": rng.uniform(-1, 1, (p, (rd or d) // 2)).astype(NP_TYPES[dtype])}
    ours = ReferenceEvaluatorRun(model, feeds)
    assert tolerance("op", dtype).allclose(ours, run_ort(model, feeds)[0])


def ReferenceEvaluatorRun(model, feeds):  # noqa: N802 - reads like the class it wraps
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=[MsRotary]).run(None, feeds)[0]


def test_contrib_node_shape_and_attributes():
    model, feeds, expected = rotary_case(layout="bhsd", rd=8, interleaved=True, x_dtype="float16",
                                         cache_dtype="float32", with_pos=True)
    lowered = lower(model, "ort", guard_positions=False)
    (rope,) = [n for n in lowered.graph.node if n.op_type == "RotaryEmbedding"]
    assert rope.domain == "com.microsoft"
    attrs = {a.name: helper.get_attribute_value(a) for a in rope.attribute}
    assert attrs == {"interleaved": 1, "num_heads": 3, "rotary_embedding_dim": 8}
    assert list(rope.input)[1] == "pos"  # X, position_ids, cos, sin
    assert ("com.microsoft", 1) in {(o.domain, o.version) for o in lowered.opset_import}
    in_range = dict(feeds, pos=np.clip(feeds["pos"], 0, 11))
    ref = run_reference(model, in_range)[0]
    assert tolerance("op", "float16").allclose(run_ort(lowered, in_range)[0], ref)


def test_without_position_ids_the_caches_are_flattened_and_indexed():
    model, feeds, expected = rotary_case(layout="bsd", with_pos=False, rd=8)
    lowered = lower(model, "ort")
    (rope,) = [n for n in lowered.graph.node if n.op_type == "RotaryEmbedding"]
    assert rope.domain == "com.microsoft"
    ops = [n.op_type for n in lowered.graph.node]
    assert "Range" in ops and "Flatten" in ops and "Reshape" not in ops  # no Reshape: batch 0 or seq 0 work
    assert tolerance("op", "float32").allclose(run_ort(lowered, feeds)[0], expected)


def test_partial_4d_without_static_heads_names_other_targets():
    model, _, _ = rotary_case(layout="bhsd", rd=8, static_dims=False)
    x = model.graph.input[0]
    x.type.tensor_type.shape.dim[1].dim_param = "h"  # head count unknown
    with pytest.raises(PassError, match="use --target onnx or --target decomposed"):
        lower(model, "ort")
    lower(model, "onnx")  # the others can
    lower(model, "decomposed")


def test_bfloat16_note_and_reference_run():
    model, feeds, expected = rotary_case(x_dtype="bfloat16", cache_dtype="bfloat16", rd=8)
    log = LoweringLog()
    lowered = lower(model, "ort", log=log)
    assert any("CUDA provider only" in n for n in log.notes)
    got = run_reference(lowered, feeds)[0]
    assert tolerance("op", "bfloat16").allclose(got.astype(np.float32), expected.astype(np.float32))
