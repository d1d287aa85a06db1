"""rope_export.exporting.precision: the float32 steps of a half-precision module are stated in the file.

A block with transformers' RMSNorm (statistics in float32) and eager attention's softmax(dtype=float32), in float16,
fed a massive activation (squares past float16's 65504): exported with the export core's translations and the norm
rewrite, onnx.reference (which ignores stash_type) and onnxruntime both compute what PyTorch computes; torchlib's own
translation and the fused norm do not state it (the softmax in float16, the statistics only in stash_type).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import rope_export.kernels.torch_op  # noqa: F401  (registers the rotary op the translation table names)
from rope_export.exporting.core import custom_translation_table
from rope_export.exporting.precision import MARK, state_norm_precision


class NormSoftmax(torch.nn.Module):
    """transformers' LlamaRMSNorm, then a softmax over the last axis in float32, back to the input's dtype."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden))

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x.to(torch.float32) * torch.rsqrt(variance + 1e-6)).to(x.dtype)
        return torch.nn.functional.softmax(normed * 4, dim=-1, dtype=torch.float32).to(x.dtype), normed


def _inputs(hidden=64):
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(0))
    x[0, 1, 3] = 1500.0  # a massive activation: its square overflows float16
    return x.half()


def _export(translations: dict):
    module = NormSoftmax(64).half().eval()
    with torch.no_grad():
        program = torch.onnx.export(module, (_inputs(),), dynamo=True, opset_version=23,
                                    custom_translation_table=translations)
    return module, program


def _types(model: ir.Model) -> dict[str, ir.DataType]:
    return {v.name: v.dtype for node in model.graph for v in (*node.inputs, *node.outputs) if v is not None}


@pytest.fixture(scope="module")
def exported():
    return _export(custom_translation_table())


def test_softmax_is_computed_in_float32_as_pytorch_defines_it(exported):
    _, program = exported
    softmax = [n for n in program.model.graph if n.op_type == "Softmax"]
    assert softmax and all(n.inputs[0].dtype == ir.DataType.FLOAT for n in softmax)
    _, default = _export({k: v for k, v in custom_translation_table().items() if "softmax" not in str(k)})
    # torchlib 0.7 computes it in the input's type and casts the result (this test notes when that changes)
    assert [n.inputs[0].dtype for n in default.model.graph if n.op_type == "Softmax"] == [ir.DataType.FLOAT16]


def test_norm_statistics_are_stated_in_float32_and_every_runner_computes_them(exported):
    module, program = exported
    fused = [n for n in program.model.graph if n.op_type == "RMSNormalization"]
    assert len(fused) == 1 and fused[0].inputs[0].dtype == ir.DataType.FLOAT16  # torch.onnx's form: stash_type only
    fused_proto = ir.to_proto(program.model)
    assert state_norm_precision(program.model) == 1
    norm = next(n for n in program.model.graph if n.op_type == "RMSNormalization")
    assert norm.inputs[0].dtype == ir.DataType.FLOAT and norm.outputs[0].dtype == ir.DataType.FLOAT
    marked = [n.op_type for n in program.model.graph if MARK in n.metadata_props]
    assert marked == ["Cast", "RMSNormalization", "Cast", "Mul"]
    stated = ir.to_proto(program.model)
    onnx.checker.check_model(stated, full_check=True)

    x = _inputs()
    with torch.no_grad():
        want = [t.float().numpy() for t in module(x)]
    feeds = {stated.graph.input[0].name: x.numpy()}
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    for name, run in (("onnx-reference", lambda m: ReferenceEvaluator(m).run(None, feeds)),
                      ("onnxruntime", lambda m: ort.InferenceSession(m.SerializeToString()).run(None, feeds))):
        got = run(stated)
        for g, w in zip(got, want, strict=True):  # the same roundings as PyTorch: within an ulp or two of float16
            assert np.allclose(g.astype(np.float32), w, atol=2e-3, rtol=2e-3), (name, np.abs(g - w).max())
    with np.errstate(all="ignore"):
        normed = ReferenceEvaluator(fused_proto).run(None, feeds)[1].astype(np.float32)
    assert not np.allclose(normed[0, 1], want[1][0, 1], atol=1e-2)  # onnx.reference squares 1500 in float16
