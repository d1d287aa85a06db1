"""Target trt-plugin: the node TensorRT's ONNX parser hands to the rope_export plugin."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
from onnx import helper
from passes_util import rotary_case, run_reference

from rope_export.passes import lower
from rope_export.passes.lower_trt_plugin import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, TRT_PLUGIN_DOMAIN
from rope_export.tolerances import tolerance

CORE_HEADER = Path(__file__).resolve().parents[2] / "plugins" / "core" / "rope_core.h"


def test_node_carries_the_plugin_routing_attributes_and_the_original_inputs():
    model, feeds, expected = rotary_case(layout="bsd", x_dtype="float16", cache_dtype="float32", rd=8)
    lowered = lower(model, "trt-plugin")
    onnx.checker.check_model(lowered, full_check=True)
    (node,) = lowered.graph.node
    assert (node.domain, node.op_type, node.name) == (TRT_PLUGIN_DOMAIN, "RotaryEmbedding", "rope_q")
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
        import pytest

        pytest.skip("plugins/core/rope_core.h is not in this checkout")
    text = CORE_HEADER.read_text()
    found = dict(re.findall(r'kPlugin(Name|Version|Namespace) = "([^"]*)"', text))
    assert found == {"Name": PLUGIN_NAME, "Version": PLUGIN_VERSION, "Namespace": PLUGIN_NAMESPACE}
