"""Every export path that makes attention states transformers' float32 steps in a half-precision file: the default
export, ``--attention-mask`` and ``--kv-buffer`` (ai.onnx Attention's ``softmax_precision``). Read from the graph by
check's own op finder (``check.layer_ops``), which is what lists an op stated below PyTorch's precision; the same
graph with the statement undone reads as half (so the finder can tell)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import onnx  # noqa: E402
from planted import LAYERS, planted_file, planted_folder, softmax_in_half  # noqa: E402

from rope_export.check.layer_ops import all_layer_stages  # noqa: E402

PATHS = {"default": {}, "attention-mask": dict(attention_mask=True), "kv-buffer": dict(kv_buffer=True)}


def _types(model: onnx.ModelProto):
    model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph
    specs = {v.name: v.type.tensor_type for v in [*graph.value_info, *graph.input, *graph.output]}
    return lambda name: specs.get(name)


def _stated(model: onnx.ModelProto) -> dict[str, set[str]]:
    """{op kind: the precisions the file states for it}, over every decoder layer's norms and softmax."""
    stages = all_layer_stages(model.graph, _types(model))
    assert sorted(stages) == list(range(LAYERS))
    found: dict[str, set[str]] = {}
    for ops in stages.values():
        assert [s.kind for s in ops].count("softmax") == 1 and [s.kind for s in ops].count("norm") == 2, ops
        for stage in ops:
            if stage.kind in ("norm", "softmax"):
                found.setdefault(stage.kind, set()).add(stage.stated)
    return found


@pytest.fixture(scope="module", params=list(PATHS))
def exported(request):
    from rope_export import hf

    if not PATHS[request.param]:
        return request.param, planted_file("fp16")  # the export the other half-precision tests check
    folder = planted_folder("fp16")
    result = hf.export_hf(hf.build_hf_model(folder, dtype="fp16"), weights=str(folder), **PATHS[request.param])
    return request.param, result.model


def test_every_attention_path_states_the_float32_steps(exported):
    path, model = exported
    assert _stated(model) == {"norm": {"float32"}, "softmax": {"float32"}}
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    assert len(attention) == (LAYERS if path == "kv-buffer" else 0)
    for node in attention:  # ONNX's default is the inputs' type: the file says float32 itself
        assert [onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "softmax_precision"] == [
            onnx.TensorProto.FLOAT]


def test_the_softmax_undone_reads_as_half(exported):
    """Without the statement (torchlib's own softmax; an Attention without softmax_precision) check's finder reads
    float16, which PyTorch computes in float32: what check lists as stated below PyTorch's precision."""
    _, model = exported
    undone = softmax_in_half(model)
    for node in undone.graph.node:
        if node.op_type == "Attention":
            kept = [a for a in node.attribute if a.name != "softmax_precision"]
            del node.attribute[:]
            node.attribute.extend(kept)
    assert _stated(undone) == {"norm": {"float32"}, "softmax": {"float16"}}
