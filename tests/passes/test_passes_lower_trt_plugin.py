"""Target trt-plugin: the node TensorRT's ONNX parser hands to the rope_export plugin, and files
lowered before the op type's rename (``RotaryEmbedding`` in trt.plugins), read as the same op."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from onnx import helper
from passes_util import rotary_case, run_reference

from rope_export.op.nodes import (
    LEGACY_PLUGIN_NAME,
    PLUGIN_NAME,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TRT_PLUGIN_DOMAIN,
    carries_contract,
)
from rope_export.op.tolerances import tolerance
from rope_export.passes import LoweringLog, lower
from rope_export.runtimes.contract_runners import CpuTwinRunner

CORE_HEADER = Path(__file__).resolve().parents[2] / "plugins" / "core" / "rope_core.h"


def test_node_carries_the_plugin_routing_attributes_and_the_original_inputs():
    model, feeds, expected = rotary_case(layout="bsd", x_dtype="float16", cache_dtype="float32", rd=8)
    lowered = lower(model, "trt-plugin")
    onnx.checker.check_model(lowered, full_check=True)
    (node,) = lowered.graph.node
    assert (node.domain, node.op_type, node.name) == (TRT_PLUGIN_DOMAIN, "RopeExportRotaryEmbedding", "rope_q")
    assert list(node.input) == ["x", "cos", "sin", "pos"]  # float32 caches stay: the plugin takes them
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"interleaved": 0, "num_heads": 3, "rotary_embedding_dim": 8,
                     "plugin_namespace": b"rope_export", "plugin_version": b"1"}
    assert (TRT_PLUGIN_DOMAIN, 1) in {(o.domain, o.version) for o in lowered.opset_import}
    got = run_reference(lowered, feeds)[0]
    assert tolerance("op", "float16").allclose(got, expected)


def test_names_match_the_plugin_library():
    """The plugin registers itself under the same name/version/namespace (plugins/core/rope_core.h)."""
    if not CORE_HEADER.is_file():
        pytest.skip("plugins/core/rope_core.h is not in this checkout")
    text = CORE_HEADER.read_text()
    found = dict(re.findall(r'kPlugin(Name|Version|Namespace) = "([^"]*)"', text))
    assert found == {"Name": PLUGIN_NAME, "Version": PLUGIN_VERSION, "Namespace": PLUGIN_NAMESPACE}


def _legacy(model: onnx.ModelProto, namespace: bytes = b"rope_export") -> onnx.ModelProto:
    """A trt-plugin file as the lowering wrote it before the rename."""
    old = onnx.ModelProto()
    old.CopyFrom(lower(model, "trt-plugin"))
    (node,) = old.graph.node
    node.op_type = LEGACY_PLUGIN_NAME
    for a in node.attribute:
        if a.name == "plugin_namespace":
            a.s = namespace
    return old


@pytest.mark.parametrize("layout, rd, interleaved", [("bsd", 8, False), ("bhsd", 0, True)])
def test_a_file_lowered_before_the_rename_is_the_same_op(layout, rd, interleaved):
    model, feeds, expected = rotary_case(layout=layout, x_dtype="float32", cache_dtype="float32", rd=rd,
                                         interleaved=interleaved)
    old = _legacy(model)
    assert carries_contract(old.graph.node[0])
    # lower: re-lowering writes the new op type with the same attributes; other targets lower it.
    log = LoweringLog()
    again = lower(old, "trt-plugin", log=log)
    assert log.notes == ["read 1 trt-plugin node(s) as rope_export::RotaryEmbedding"]
    (node,) = again.graph.node
    assert node.op_type == PLUGIN_NAME
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {
        a.name: helper.get_attribute_value(a) for a in lower(model, "trt-plugin").graph.node[0].attribute}
    standard = lower(old, "onnx")
    assert not any(n.domain == TRT_PLUGIN_DOMAIN for n in standard.graph.node)
    for lowered in (again, standard):
        assert tolerance("op", "float32").allclose(run_reference(lowered, feeds)[0], expected)
    # the runners: onnx.reference and the CPU twin know the old op type
    runner = CpuTwinRunner(old)
    with runner:
        (got,) = runner.infer(feeds).values()
    assert tolerance("op", "float32").allclose(got, expected)


def test_another_librarys_plugin_node_is_left_alone():
    model, _, _ = rotary_case(layout="bsd", x_dtype="float32", cache_dtype="float32", rd=8)
    other = _legacy(model, namespace=b"someone_else")
    assert not carries_contract(other.graph.node[0])
    log = LoweringLog()
    kept = lower(other, "onnx", log=log)
    assert [(n.domain, n.op_type) for n in kept.graph.node] == [(TRT_PLUGIN_DOMAIN, LEGACY_PLUGIN_NAME)]
    assert log.notes == ["no rope_export::RotaryEmbedding node in the model; nothing to lower"]
