"""Every preset x dtype x target: the lowered exported block matches the PyTorch block.

Files come from rope_export.presets.export (shared, cached: tests/exported.py); onnxruntime CPU runs the
fp32/fp16 files, onnx.reference the bfloat16 ones and the trt-plugin ones (no TensorRT here).
A second set builds one-node graphs from each preset's own caches, independent of the exporter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exported import CACHE_LEN, exported_model, feeds, test_block
from onnx import TensorProto, helper, numpy_helper
from passes_util import NP_TYPES, TORCH_TYPES, as_f32, run_ort, run_reference

from rope_export.exporting.core import DTYPES
from rope_export.op.contract import DOMAIN, RotaryAttrs
from rope_export.op.onnx_op import make_rotary_node
from rope_export.op.tolerances import tolerance
from rope_export.passes import TARGETS, lower
from rope_export.presets import load_preset, preset_names
from rope_export.presets.export import example_inputs

NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _shapes(preset_name):
    """(batch, seq, past, first position): prefill, decode far out, and (static caches) a call that
    runs past the cache, where the contract passes tokens through."""
    rope = load_preset(preset_name).rope
    if rope.seq_len_dependent:
        return [(2, 5, 0, 0), (1, 1, 3, rope.original_max_positions + 100)]
    return [(2, 5, 0, 0), (1, 1, 3, CACHE_LEN - 4), (1, 4, 2, CACHE_LEN - 2)]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("preset_name", preset_names())
def test_lowered_export_matches_pytorch_block(preset_name, dtype, target):
    model = exported_model(preset_name, dtype)
    lowered = lower(model, target)
    assert [i.name for i in lowered.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in lowered.graph.output] == [o.name for o in model.graph.output]
    block = test_block(preset_name, dtype)
    preset = load_preset(preset_name).scaled_down()
    tol = tolerance("block", NAMES[dtype])
    use_reference = dtype == "bf16" or target == "trt-plugin"
    for batch, seq, past, start in _shapes(preset_name):
        inputs = example_inputs(preset, DTYPES[dtype], True, batch, seq, past, seed=7)
        inputs = (inputs[0], inputs[1] - past + start, *inputs[2:])
        with torch.no_grad():
            want = block(*inputs)
        got = (run_reference if use_reference else run_ort)(lowered, feeds(inputs))
        for g, w in zip(got, want, strict=True):
            assert tol.allclose(as_f32(g), w.float().numpy()), (
                f"{preset_name} {dtype} {target} B{batch} S{seq} start {start}: "
                f"max error {np.abs(as_f32(g) - w.float().numpy()).max():.3g}"
            )


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("preset_name", preset_names())
def test_one_node_graph_with_the_presets_caches(preset_name, dtype, target):
    """The preset's rotary on q as the block applies it ([B, S, H*D], num_heads), caches as built."""
    preset = load_preset(preset_name).scaled_down()
    block = preset.build_block(TORCH_TYPES[NAMES[dtype]], cache_len=32)
    rotary, att = block.rotary, preset.attention
    batch, seq = 2, 6
    positions = (torch.arange(seq) + 27).expand(batch, seq).contiguous()  # 32 and 33 are past the cache
    x = torch.randn(batch, seq, att.num_heads * att.head_dim, generator=torch.Generator().manual_seed(1))
    x = x.to(TORCH_TYPES[NAMES[dtype]])
    cos, sin, pos = rotary.cos_sin(positions)
    with torch.no_grad():
        want = rotary.apply(x, cos, sin, pos, num_heads=att.num_heads)
    attrs = RotaryAttrs(preset.rope.interleaved, att.num_heads, preset.rope.rotary_embedding_dim)
    xt = helper.make_tensor_value_info("x", {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}[dtype],
                                       ["b", "s", att.num_heads * att.head_dim])
    inputs, inits = [xt], []
    run_feeds = {"x": x.numpy()}
    if pos is not None:
        inits = [numpy_helper.from_array(cos.numpy(), "cos"), numpy_helper.from_array(sin.numpy(), "sin")]
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, ["b", "s"]))
        run_feeds["pos"] = pos.numpy()
    else:  # seq-len-dependent scheme: per-token caches computed by the block, fed as inputs
        for name, value in (("cos", cos), ("sin", sin)):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", "s", value.shape[-1]]))
            run_feeds[name] = value.numpy().astype(np.float32)
    node = make_rotary_node("x", "cos", "sin", "pos" if pos is not None else None, "y", attrs, name="rope")
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", xt.type.tensor_type.elem_type,
                                                                                   None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    lowered = lower(model, target)
    got = (run_reference if target == "trt-plugin" else run_ort)(lowered, run_feeds)[0]
    assert got.dtype == NP_TYPES[NAMES[dtype]]
    assert tolerance("op", NAMES[dtype]).allclose(got, want.numpy())
