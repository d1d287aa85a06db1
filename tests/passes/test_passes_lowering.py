"""Every target x layout x partial/interleaved x dtypes x with/without position_ids: the lowered
file computes the op contract (rope_export.op.reference), out-of-range positions included."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from passes_util import as_f32, ops_of, reference_output, rotary_case, run_ort, run_reference

from rope_export.op.contract import DOMAIN, RotaryAttrs
from rope_export.op.tolerances import tolerance
from rope_export.passes import TARGETS, LoweringLog, PassError, lower

DTYPE_PAIRS = [  # (X, caches)
    ("float32", "float32"),
    ("float16", "float16"),
    ("float16", "float32"),
    ("bfloat16", "float32"),
    ("bfloat16", "bfloat16"),
]
GEOMETRIES = list(itertools.product(("bhsd", "bsd"), (0, 8), (False, True)))  # layout, rd, interleaved


def _run(target: str, model: onnx.ModelProto, feeds: dict, x_dtype: str):
    """onnxruntime CPU where it has kernels, onnx.reference otherwise (trt-plugin, bfloat16)."""
    if target == "trt-plugin" or x_dtype == "bfloat16":
        return run_reference(model, feeds)[0]
    return run_ort(model, feeds)[0]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("x_dtype,cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("layout,rd,interleaved", GEOMETRIES)
@pytest.mark.parametrize("with_pos", [True, False])
def test_lowered_file_matches_reference(target, x_dtype, cache_dtype, layout, rd, interleaved, with_pos):
    model, feeds, expected = rotary_case(layout, x_dtype, cache_dtype, rd, interleaved, with_pos)
    log = LoweringLog()
    lowered = lower(model, target, log=log)
    onnx.checker.check_model(lowered, full_check=True)
    assert log.lowered == ["rope_q"]
    assert (DOMAIN, "RotaryEmbedding") not in ops_of(lowered)
    assert DOMAIN not in {o.domain for o in lowered.opset_import}
    assert [i.name for i in lowered.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in lowered.graph.output] == ["y"]
    got = _run(target, lowered, feeds, x_dtype)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    error = np.abs(as_f32(got) - as_f32(expected)).max()
    assert tolerance("op", x_dtype).allclose(as_f32(got), as_f32(expected)), error


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
@pytest.mark.parametrize("x_dtype", ["float32", "float16"])
def test_multi_node_graph_with_dynamic_dims(target, x_dtype):
    model, feeds, expected = rotary_case("bhsd", x_dtype, "float32", rd=8, interleaved=True, multi_node=True,
                                         static_dims=False, seed=3)
    lowered = lower(model, target)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_ort(lowered, feeds)[0]
    assert tolerance("op", x_dtype).allclose(got, expected)
    assert [n.name for n in lowered.graph.node if n.name in ("proj", "residual")] == ["proj", "residual"]


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
def test_q_and_k_share_one_guarded_gather(target):
    """Two nodes on the same caches and positions (q and k): the per-token caches are built once."""
    model, feeds, expected = rotary_case(layout="bsd", rd=8, seed=8)
    k_node = onnx.helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y2"], domain=DOMAIN,
                                   name="rope_k", interleaved=0, num_heads=3, rotary_embedding_dim=8)
    model.graph.node.append(k_node)
    model.graph.output.append(onnx.helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, None))
    lowered = lower(model, target)
    gathers = [n.input[0] for n in lowered.graph.node if n.op_type == "Gather" and n.input[0] in ("cos", "sin")]
    assert sorted(gathers) == ["cos", "sin"]  # cos and sin, once
    y, y2 = run_ort(lowered, feeds)
    assert tolerance("op", "float32").allclose(y, expected) and tolerance("op", "float32").allclose(y2, expected)


@pytest.mark.parametrize("target", list(TARGETS))
def test_lowering_is_idempotent_and_a_noop_without_custom_nodes(target):
    model, feeds, _ = rotary_case(seed=5)
    once = lower(model, target)
    log = LoweringLog()
    twice = lower(once, target, log=log)
    assert twice.graph == once.graph
    assert any("nothing to lower" in note for note in log.notes)


def test_unknown_target_names_the_targets():
    model, _, _ = rotary_case()
    with pytest.raises(PassError, match="choose one of: trt-plugin, onnx, ort, decomposed"):
        lower(model, "tensorrt")


def test_contract_violation_is_reported_with_the_node_and_a_fix():
    model, _, _ = rotary_case(layout="bsd")
    for attr in model.graph.node[0].attribute:
        if attr.name == "num_heads":
            attr.i = 0  # 3-D X without num_heads
    with pytest.raises(PassError, match=r"rope_q: 3-D X \[B, S, H\*D\] needs the num_heads attribute"):
        lower(model, "decomposed")


def test_ir_model_is_accepted_and_returned():
    import onnx_ir as ir

    model, feeds, expected = rotary_case(seed=7)
    lowered = lower(ir.from_proto(model), "decomposed")
    assert isinstance(lowered, ir.Model)
    got = run_ort(ir.to_proto(lowered), feeds)[0]
    assert tolerance("op", "float32").allclose(got, expected)


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
@pytest.mark.parametrize("layout", ["bhsd", "bsd"])
def test_caches_shared_by_the_batch_are_expanded_for_onnxruntime(target, layout):
    """Per-token caches [1, S, rd/2] under X of batch 3: onnxruntime's kernels refuse them as they are
    ("got 1 and 3"), so the lowering expands them to X's batch; the result is the contract's per batch row."""
    model, feeds, _ = rotary_case(layout, with_pos=False, static_dims=False, batch=3, seed=5, rd=8)
    for value in model.graph.input[1:]:  # cos, sin: [1, s, rd/2]
        value.type.tensor_type.shape.dim[0].Clear()
        value.type.tensor_type.shape.dim[0].dim_value = 1
    cos, sin = feeds["cos"][:1], feeds["sin"][:1]
    feeds = dict(feeds, cos=cos, sin=sin)
    heads = 3
    attrs = RotaryAttrs(False, heads if layout == "bsd" else 0, 8)
    expected = reference_output(feeds["x"], np.repeat(cos, 3, axis=0), np.repeat(sin, 3, axis=0), None, attrs)
    lowered = lower(model, target, validate=True)
    assert tolerance("op", "float32").allclose(run_ort(lowered, feeds)[0], expected)
