"""Every lowering of the layouts the op does not take natively (issue #25): sequence-first ``[S, B, H, D]``,
token-major ``[T, H, D]``, per-head tables folded into the batch, per-pair caches, the 5-D pair view and the
complex spellings, fused by a reshape/transpose around one node. Each fused file is lowered to every target
and run against the eager block: ``onnx``, ``ort`` (com.microsoft RotaryEmbedding) and ``decomposed`` on
onnxruntime, ``trt-plugin`` with its nodes run by the plugin's CPU twin (``CpuTwinRunner``; skipped when
the twin library is not built). Batch 3 (traced with 2), positions past the traced ones where they are an
input; within the op's fp32 tolerance (``rope_export.op.tolerances``) at each output's scale.
Blocks: tests/rope_blocks.py, tests/complex_blocks.py, tests/layout_blocks.py."""

from __future__ import annotations

import functools

import complex_blocks as cb
import layout_blocks as lb
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import rope_blocks as rb
import torch
import vision_blocks as vb

import rope_export
from rope_export.kernels import libraries
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.nodes import PLUGIN_NAME, TRT_PLUGIN_DOMAIN
from rope_export.op.tolerances import tolerance
from rope_export.passes import fuse, lower
from rope_export.runtimes.contract_runners import CpuTwinRunner

TARGETS = ("trt-plugin", "onnx", "ort", "decomposed")
TOLERANCE = tolerance("op", "float32")

# rope_blocks' layout forms: fuse of their plain export (opset 18)
ZOO = ("sequence_first", "token_major", "per_head_angles", "per_head_interleaved_partial", "per_head_stack",
       "per_head_pairs")
# complex spellings (export_module: torch.onnx cannot export complex tensors); mistral is token-major
COMPLEX = ("mistral", "mistral_partial", "per_head_complex", "heads_first", "titan_positions", "gptfast")
# vision blocks (export_module, coordinates as input): the planted learned per-head 2-D frequencies (heads
# folded into the batch), Qwen2-VL's token-major [N, H, D], Pixtral's cos/sin [N, D] with unsqueeze_dim=0
VISION = ("vision_per_head", "qwen_vision", "pixtral")
# the third-party blocks of tests/layout_blocks.py (export_module)
THIRD_PARTY = ("megatron", "megatron_interleaved_partial", "megatron_mscale", "megatron_batch_positions",
               "timm_mixed", "megatron:fuse", "timm_mixed:fuse")  # ":fuse": fuse of the plain torch.onnx export
SLOW = ("heads_first", "titan_positions", "gptfast", "per_head_stack", "pixtral")


def _twin_reason() -> str | None:
    try:
        libraries.library_path(libraries.TWIN_LIBRARY)
    except libraries.PluginNotBuiltError as exc:
        return f"the CPU twin is not built: {exc}"
    return None


@functools.cache
def fused(name: str) -> onnx.ModelProto:
    if name in ZOO:
        return fuse(rb.plain_export(name, 18))
    if name in COMPLEX:
        return rope_export.export_module(cb.block(name), rb.example()).model
    if name in VISION:
        block, args = _vision(name)
        n = torch.export.Dim("n")
        dynamic = ({0: n}, {0: n}) if name == "qwen_vision" else ({0: torch.export.Dim("batch"), 1: n}, {0: n})
        return rope_export.export_module(block, args, dynamic_shapes=dynamic).model
    if name.endswith(":fuse"):
        return fuse(lb.plain_export(name.removesuffix(":fuse")))
    return rope_export.export_module(lb.block(name), lb.example(name)).model


def _vision(name: str, **kwargs):
    """(block, example) of a vision block; ``kwargs`` for the example (another batch, grid offset)."""
    if name == "qwen_vision":
        return vb.qwen_vision(), vb.token_major_example(**kwargs)
    return (vb.planted("per_head") if name == "vision_per_head" else vb.pixtral()), vb.example(**kwargs)


def cases(name: str):
    """(feeds as tensors, eager outputs) at batch 3: positions offset past the traced ones where an input."""
    name = name.removesuffix(":fuse")
    if name in ZOO or name in COMPLEX:
        block = rb.block(name) if name in ZOO else cb.block(name)
        args = rb.example(batch=3, seq=3, offset=7, seed=9)
    elif name in VISION:  # coordinates past the traced grid
        block, args = _vision(name, offset=9, seed=4, **({} if name == "qwen_vision" else {"batch": 3}))
    elif name == "timm_mixed":
        block, args = lb.block(name), lb.example(name, batch=3, seed=9)
    elif name == "megatron_batch_positions":
        block, args = lb.block(name), lb.example(name, seq=4, batch=3, offset=11, seed=9)
    else:
        block, args = lb.block(name), lb.example(name, seq=7, batch=3, seed=9)
    with torch.no_grad():
        want = [t for t in torch.utils._pytree.tree_leaves(block(*args)) if isinstance(t, torch.Tensor)]
    return args, want


def run(model: onnx.ModelProto, target: str, args) -> list[np.ndarray]:
    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    feeds = dict(zip(names, (a.numpy() for a in args), strict=True))
    if target == "trt-plugin":
        with CpuTwinRunner(model) as runner:
            return list(runner.infer(feeds).values())
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _twin_marks(target: str) -> list:
    reason = _twin_reason() if target == "trt-plugin" else None
    return [pytest.mark.skip(reason=reason)] if reason else []


def _params():
    out = []
    for name in (*ZOO, *COMPLEX, *VISION, *THIRD_PARTY):
        for target in TARGETS:
            marks = ([pytest.mark.slow] if name in SLOW else []) + _twin_marks(target)
            out.append(pytest.param(name, target, marks=marks, id=f"{name}-{target}"))
    return out


@pytest.mark.parametrize("name,target", _params())
def test_every_lowering_of_a_fused_layout_computes_the_block(name, target):
    model = fused(name)
    assert sum(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph.node) >= 2
    lowered = lower(model, target, validate=True)
    onnx.checker.check_model(lowered, full_check=True)
    kinds = {(n.domain, n.op_type) for n in lowered.graph.node}
    assert (DOMAIN, OP_TYPE) not in kinds
    expected_node = {"trt-plugin": (TRT_PLUGIN_DOMAIN, PLUGIN_NAME), "onnx": ("", "RotaryEmbedding"),
                     "ort": ("com.microsoft", "RotaryEmbedding"), "decomposed": None}[target]
    if expected_node is None:
        assert not any(op == "RotaryEmbedding" for _, op in kinds)
    else:
        assert expected_node in kinds, kinds
    args, want = cases(name)
    got = run(lowered, target, args)
    for g, w in zip(got, want, strict=True):
        w = w.numpy()
        assert g.shape == w.shape
        err = float(np.max(np.abs(g - w)))
        # the op's fp32 tolerance at the output's scale (timm's residual stream has RMS ~5 after two blocks)
        assert TOLERANCE.at_scale_of(w).allclose(g, w), f"{name} lowered to {target}: max error {err:.3g}"


@functools.cache
def megatron_half() -> onnx.ModelProto:
    (x,) = lb.example("megatron")
    return rope_export.export_module(lb.block("megatron").half(), (x.half(),)).model


@pytest.mark.parametrize("target", [pytest.param(t, marks=_twin_marks(t)) for t in TARGETS])
def test_half_precision_sequence_first_on_every_target(target):
    """Megatron's fp16 block ([S, B, H, D] fp16, caches computed in the graph): every lowering equals the eager
    fp16 block within the block tolerance for fp16 (matmuls round in other orders)."""
    lowered = lower(megatron_half(), target, validate=True)
    (x,) = lb.example("megatron", seq=7, batch=3, seed=4)
    block = lb.block("megatron").half()
    with torch.no_grad():
        want = [w.float().numpy() for w in block(x.half())]
    got = run(lowered, target, (x.half(),))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float16
        assert tolerance("block", "float16").at_scale_of(w).allclose(g.astype(np.float32), w), (
            f"{target}: max error {np.max(np.abs(g.astype(np.float32) - w)):.3g}")
