"""A tiny transformers Llama with trained-like statistics, saved as a checkpoint and exported in half precision.

For any test that needs what random weights hide (massive activations, an outlier feature, q/k outlier dims
with attention sinks and large logits): ``planted_folder(dtype)`` is a folder save_pretrained wrote (config and
safetensors, the statistics planted by ``rope_export.hf.planting``), ``planted_file(dtype)`` its ``export --hf``
file (read-only: copy before changing it), both made once per session. Hidden 128 so that a float16 square of
the massive channels overflows and a bfloat16 sum over the hidden size loses the small terms, as at real sizes.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import onnx

LAYERS = 2
CONFIG = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)
# check's cases, kept small: a sink token is among them (one token id in eight is a sink)
CASES = dict(batch=1, seq=16, past=4, long_seq=32, sweep=False)
_FOLDERS = tempfile.TemporaryDirectory(prefix="rope-export-planted-")


@functools.cache
def planted_folder(dtype: str = "fp16") -> Path:
    import torch
    import transformers

    from rope_export import hf
    from rope_export.hf.planting import plant_trained_statistics

    model = hf.build_hf_model(transformers.LlamaConfig(**CONFIG), seed=0)
    plant_trained_statistics(model, seed=0)
    folder = Path(_FOLDERS.name) / dtype
    model.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]).save_pretrained(folder)
    return folder


@functools.cache
def planted_file(dtype: str = "fp16") -> onnx.ModelProto:
    from rope_export import hf

    folder = planted_folder(dtype)
    return hf.export_hf(hf.build_hf_model(folder, dtype=dtype), weights=str(folder)).model


# -- the same file with one of its float32 steps undone (rope_export.exporting.precision) ---------------------

def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _producers(graph) -> dict:
    return {out: node for node in graph.node for out in node.output}


def _stated_norms(graph):
    """(up Cast, norm, down Cast, Mul by the weight) of each norm precision.state_norm_precision wrote."""
    from rope_export.exporting.precision import MARK

    producers = _producers(graph)
    for mul in [n for n in graph.node if n.op_type == "Mul" and any(p.key == MARK for p in n.metadata_props)]:
        down = producers[mul.input[0]]
        norm = producers[down.input[0]]
        yield producers[norm.input[0]], norm, down, mul


def _replace(graph, old: list, new: list) -> None:
    at = min(list(graph.node).index(n) for n in old)
    for node in old:
        graph.node.remove(node)
    for k, node in enumerate(new):
        graph.node.insert(at + k, node)


def softmax_in_half(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each Softmax fed by a Cast to float32 and read by a Cast back: both Casts dropped (the softmax in half)."""
    out = _copy(model)
    graph = out.graph
    producers = _producers(graph)
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for softmax in [n for n in graph.node if n.op_type == "Softmax"]:
        up, down = producers.get(softmax.input[0]), readers.get(softmax.output[0], [])
        if up is not None and up.op_type == "Cast" and len(down) == 1 and down[0].op_type == "Cast":
            softmax.input[0], softmax.output[0] = up.input[0], down[0].output[0]
            graph.node.remove(down[0])
    return out


def norm_fused(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each stated norm back to torch.onnx's fused form: the norm on the half input with the weight as its scale and
    stash_type 1 (float32 statistics, stated by an attribute that onnx.reference ignores)."""
    from onnx import helper

    out = _copy(model)
    for up, norm, down, mul in list(_stated_norms(out.graph)):
        fused = helper.make_node(norm.op_type, [up.input[0], mul.input[1]], [mul.output[0]], name=norm.name + ".fused")
        fused.attribute.extend(a for a in norm.attribute if a.name != "stash_type")
        fused.attribute.append(helper.make_attribute("stash_type", 1))
        fused.metadata_props.extend(norm.metadata_props)
        _replace(out.graph, [up, norm, down, mul], [fused])
    return out


def norm_statistics_in_half(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each stated RMS norm written out in plain ops on its half input: x*x, ReduceMean, +eps, Sqrt, Div, Mul."""
    from onnx import helper, numpy_helper

    out = _copy(model)
    graph = out.graph
    for k, (up, norm, down, mul) in enumerate(list(_stated_norms(graph))):
        assert norm.op_type == "RMSNormalization"
        x, p = up.input[0], f"half_norm.{k}."
        eps = next(a.f for a in norm.attribute if a.name == "epsilon")
        half = next(a.i for a in down.attribute if a.name == "to")
        nodes = [helper.make_node("Mul", [x, x], [p + "square"]),
                 helper.make_node("ReduceMean", [p + "square", p + "axes"], [p + "mean"], keepdims=1),
                 helper.make_node("Add", [p + "mean", p + "eps"], [p + "variance"]),
                 helper.make_node("Sqrt", [p + "variance"], [p + "rms"]),
                 helper.make_node("Div", [x, p + "rms"], [p + "normalized"]),
                 helper.make_node("Mul", [p + "normalized", mul.input[1]], [mul.output[0]])]
        for node in nodes:
            node.metadata_props.extend(q for q in norm.metadata_props if q.key != "rope_export.float32_step")
        graph.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), p + "axes"),
                                  helper.make_tensor(p + "eps", half, [], [eps])])
        _replace(graph, [up, norm, down, mul], nodes)
    return out
