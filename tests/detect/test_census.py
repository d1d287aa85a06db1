"""compare_with_file: the eager census against the rotary nodes of a file, in every node form."""

from __future__ import annotations

import warnings

import onnx
import pytest
from onnx import TensorProto, helper

from rope_export.detect import (
    DecomposedRotationError,
    RotationCensus,
    RotationCountError,
    RotationSite,
    compare_with_file,
    count_rotations,
    rotary_nodes,
)
from rope_export.op.nodes import PLUGIN_NAME


def _scoped(node, path: str):
    scopes = [""] + [".".join(path.split(".")[: i + 1]) for i in range(len(path.split(".")))] + ["add"]
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr(scopes))
    return node


def _model(nodes) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])
    graph = helper.make_graph(nodes, "g", [x], [x])
    return helper.make_model(graph)


def _node(kind: str, i: int, path: str | None = None):
    if kind == "rope_export":
        node = helper.make_node("RotaryEmbedding", ["x", "c", "s"], [f"y{i}"], domain="rope_export", name=f"n{i}")
    elif kind == "trt-plugin":  # as the TensorRT lowering writes it
        node = helper.make_node(PLUGIN_NAME, ["x", "c", "s"], [f"y{i}"], domain="trt.plugins", name=f"n{i}",
                                plugin_namespace="rope_export", plugin_version="1")
    elif kind == "onnx":
        node = helper.make_node("RotaryEmbedding", ["x", "c", "s"], [f"y{i}"], name=f"n{i}")
    else:
        node = helper.make_node("RotaryEmbedding", ["x", "p", "c", "s"], [f"y{i}"], domain="com.microsoft",
                                name=f"n{i}")
    return _scoped(node, path) if path else node


def _census(layers: list[int], scaled: int = 0) -> RotationCensus:
    sites = [RotationSite(f"model.layers.{layer}.self_attn", layer, (1, 2, 3, 4), "real") for layer in layers]
    sites += [RotationSite("model.layers.9.attn", 9, (1, 2, 3, 4), "real", scaled=True)] * scaled
    return RotationCensus(sites)


def test_every_node_form_is_counted():
    kinds = ["rope_export", "trt-plugin", "onnx", "ort"]
    nodes = rotary_nodes(_model([_node(k, i) for i, k in enumerate(kinds)]
                                + [helper.make_node("Add", ["x", "x"], ["z"])]))
    assert [n.kind for n in nodes] == kinds
    report = compare_with_file(_census([0, 0, 1, 1]), _model([_node(k, i) for i, k in enumerate(kinds)]))
    assert report.ok and report.by_kind == dict.fromkeys(kinds, 1)


def test_a_shortfall_names_the_layers_left_decomposed():
    census = _census([0, 0, 1, 1, 2, 2])
    model = _model([_node("rope_export", i, f"model.layers.{layer}.self_attn") for i, layer in enumerate([0, 0, 2])])
    with pytest.raises(DecomposedRotationError, match="3 of 6") as info:
        compare_with_file(census, model)
    text = str(info.value)
    assert "layer 1: 2 of 2 rotation(s) (model.layers.1.self_attn)" in text
    assert "layer 2: 1 of 2 rotation(s)" in text and "layer 0" not in text.split("left decomposed")[1]


def test_without_scopes_every_site_is_listed():
    with pytest.raises(DecomposedRotationError, match="cannot be told apart") as info:
        compare_with_file(_census([0, 1]), _model([_node("onnx", 0)]))
    assert "model.layers.0.self_attn" in str(info.value) and "model.layers.1.self_attn" in str(info.value)


def test_allow_decomposed_warns_instead():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = compare_with_file(_census([0, 0]), _model([]), allow_decomposed=True)
    assert not report.ok and report.found == 0 and "2 of 2 rotation(s) stayed decomposed" in str(caught[0].message)


def test_more_nodes_than_rotations_is_an_error_too():
    with pytest.raises(RotationCountError, match="not a RoPE rotation was fused") as info:
        compare_with_file(_census([0]), _model([_node("rope_export", 0), _node("rope_export", 1)]))
    assert not isinstance(info.value, DecomposedRotationError)


def test_scaled_rotations_are_refused_not_expected():
    report = compare_with_file(_census([0, 0], scaled=2), _model([_node("rope_export", 0), _node("rope_export", 1)]))
    assert report.ok and report.expected == 2 and len(report.refused) == 2
    assert "refused (not plain RoPE, left decomposed): model.layers.9.attn: xPos-style" in report.as_text()


def test_real_export_fused_and_plain():
    """tests/passes' Llama attention export: the plain file fails the count, the fused one passes."""
    hf_models = pytest.importorskip("hf_models")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from rope_export.passes import fuse

    plain = hf_models.exported("llama", "dynamo")
    model = AutoModelForCausalLM.from_config(hf_models.config("llama"), attn_implementation="eager").eval()
    census = count_rotations(hf_models.Attention("llama", model), hf_models.example(seq=4))
    assert census.total == 2
    with pytest.raises(DecomposedRotationError):
        compare_with_file(census, plain)
    report = compare_with_file(census, fuse(plain))
    assert report.ok and report.by_kind == {"rope_export": 2}
    # the fused nodes keep torch.onnx's module scopes, so they are attributed
    assert {n.module_path for n in rotary_nodes(fuse(plain))} == {"attn"}
