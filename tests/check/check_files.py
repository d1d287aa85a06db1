"""Files the check tests share, each made once per session, and ways to break them.

Transformers models are tiny (one layer, hidden 32) and built offline from configs; their exports
and lowerings come from rope-export itself. ``one_node_file`` is written by hand with onnx.helper,
the way another tool would write a file with our op and no metadata.
"""

from __future__ import annotations

import functools

import exported
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.rope_types import RopeConfig, build_caches
from rope_export.presets import load_preset
from rope_export.presets.export import export

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              max_position_embeddings=128, pad_token_id=None, bos_token_id=None, eos_token_id=None)
FAMILIES = ("llama", "qwen2", "phi3", "gptj", "qwen2_vl")
TARGETS = ("trt-plugin", "onnx", "ort", "decomposed")
# the runners that can run each form (the others skip it with a reason, which costs nothing)
RUNNERS_FOR = {None: ("onnx-reference", "cpu-twin", "onnxruntime-cpu"), "trt-plugin": ("cpu-twin",),
               "onnx": ("onnxruntime-cpu", "onnx-reference"), "ort": ("onnxruntime-cpu",),
               "decomposed": ("onnxruntime-cpu",)}


def _rope(rope_type="default", **extra):
    return {"rope_type": rope_type, "rope_theta": 10000.0, **extra}


def hf_config(family: str):
    import transformers as tf

    configs = {
        "llama": lambda: tf.LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters=_rope(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)),
        "qwen2": lambda: tf.Qwen2Config(**COMMON, num_key_value_heads=2),
        "phi3": lambda: tf.Phi3Config(**COMMON, num_key_value_heads=2, original_max_position_embeddings=32,
                                      rope_parameters=_rope("longrope", partial_rotary_factor=0.5,
                                                            short_factor=[1.0, 1.5], long_factor=[2.0, 4.0],
                                                            original_max_position_embeddings=32)),
        # n_positions <= 32: onnx.reference's GatherElements (np.choose) cannot index more rows
        "gptj": lambda: tf.GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, rotary_dim=4,
                                      bos_token_id=None, eos_token_id=None),
        "qwen2_vl": lambda: tf.Qwen2VLConfig(
            text_config=dict(**COMMON, num_key_value_heads=2, rope_parameters=_rope(mrope_section=[1, 1, 2])),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=1, patch_size=2,
                               spatial_merge_size=1, temporal_patch_size=1)),
    }
    return configs[family]()


@functools.cache
def hf_model(family: str):
    from rope_export import hf

    return hf.build_hf_model(hf_config(family), seed=0)


@functools.cache
def hf_file(family: str, target: str | None = None) -> onnx.ModelProto:
    """``export --hf`` of the tiny model (random weights, seed 0), lowered to ``target`` (read-only: copy first)."""
    from rope_export import hf
    from rope_export.passes import lower

    if target is not None:
        return lower(hf_file(family), target)
    return hf.export_hf(hf_model(family)).model


class _LMWithPast(torch.nn.Module):
    """(input_ids, position_ids, past key/value per layer) -> (logits, present key/value per layer)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, past_key, past_value):
        from transformers.cache_utils import DynamicCache

        from rope_export.hf.cache_io import returned_cache, with_cache

        cache = DynamicCache()
        cache.update(past_key, past_value, 0)
        out = with_cache(self.model, cache, input_ids=input_ids, position_ids=position_ids)
        layer = returned_cache(out).layers[0]
        return out.logits, layer.keys, layer.values


@functools.cache
def plain_and_fused() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """A plain torch.onnx export of tiny Llama with a KV cache (the user's own, no rope_export metadata),
    and ``rope-export fuse`` of it."""
    from rope_export.exporting.torch_onnx import quiet_exporter
    from rope_export.hf import hf_io_names
    from rope_export.passes import fuse

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 4), generator=generator)
    positions = (torch.arange(4) + 3).expand(2, -1).contiguous()
    past = [torch.randn(2, 2, 3, 8, generator=generator) for _ in range(2)]
    batch, seq, past_len = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    inputs, outputs = hf_io_names(1)
    with torch.no_grad(), quiet_exporter(False):
        plain = torch.onnx.export(_LMWithPast(hf_model("llama")), (ids, positions, *past), dynamo=True,
                                  opset_version=18, input_names=inputs, output_names=outputs,
                                  dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq},
                                                  {0: batch, 2: past_len}, {0: batch, 2: past_len})).model_proto
    return plain, fuse(plain)


@functools.cache
def preset_file(dtype: str = "fp32", cache_len: int = 512) -> onnx.ModelProto:
    """The tiny preset's export with a KV cache (read-only: copy first); 64 rows: the file other tests share."""
    if cache_len == exported.CACHE_LEN:
        return exported.exported_model("tiny", dtype)
    return export(load_preset("tiny"), dtype=dtype, decode=True, cache_len=cache_len).model


def one_node_file(rows: int = 512, heads: int = 2, head_dim: int = 8, interleaved: int = 0) -> onnx.ModelProto:
    """One rope_export::RotaryEmbedding node, caches as initializers, position_ids an input, no metadata."""
    cos, sin = build_caches(RopeConfig(head_dim=head_dim, rope_theta=500.0, max_position_embeddings=rows))
    node = helper.make_node(OP_TYPE, ["x", "cos", "sin", "position_ids"], ["y"], domain=DOMAIN,
                            interleaved=interleaved)
    graph = helper.make_graph(
        [node], "one rotary node",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", heads, "seq", head_dim]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", heads, "seq", head_dim])],
        initializer=[numpy_helper.from_array(cos.numpy(), "cos"), numpy_helper.from_array(sin.numpy(), "sin")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


# -- breaking files ------------------------------------------------------------------------------

def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def rotary_nodes(model):
    return [n for n in model.graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]


def flip_interleaved(model):
    model = copy(model)
    for node in rotary_nodes(model):
        attr = next((a for a in node.attribute if a.name == "interleaved"), None)
        if attr is None:
            node.attribute.append(helper.make_attribute("interleaved", 1))
        else:
            attr.i = 1 - attr.i
    return model


def swap_cos_sin(model):
    model = copy(model)
    for node in rotary_nodes(model):
        node.input[1], node.input[2] = node.input[2], node.input[1]
    return model


def shift_positions(model):
    """Every reader of the position_ids input reads position_ids + 1."""
    model = copy(model)
    shifted, one = "position_ids_plus_one", "one_i64"
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == "position_ids":
                node.input[i] = shifted
    model.graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=np.int64), one))
    model.graph.node.insert(0, helper.make_node("Add", ["position_ids", one], [shifted]))
    return model


TAMPERING = {"flipped-interleaved": flip_interleaved, "cos-sin-swapped": swap_cos_sin,
             "positions-shifted": shift_positions}


def change_cache_rows(model, rows: slice | int, role: str = "cos", how=lambda v: -v):
    """The stored cos (or sin) table with ``rows`` changed by ``how`` (negated by default)."""
    model = copy(model)
    node = rotary_nodes(model)[0]
    name = node.input[1 if role == "cos" else 2]
    init = next(i for i in model.graph.initializer if i.name == name)
    table = numpy_helper.to_array(init).copy()
    table[rows] = how(table[rows])
    init.CopyFrom(numpy_helper.from_array(table, name))
    return model
