"""Lowering rule ``onnx``: the standard ``ai.onnx`` RotaryEmbedding-23.

The standard op needs caches of X's type, so float32 caches under float16/bfloat16 X are cast.
It has no pass-through for out-of-range positions (onnxruntime's CPU kernel rejects them), so by
default (``guard_positions=True``) the lowering gathers per-token caches itself with clamped
indices and ``Where(valid, row, identity)`` and feeds the op without position_ids. With
``guard_positions=False`` position_ids go straight to the op: faster, but positions must then
lie in [0, max_pos) (onnxruntime's kernel also refuses a sequence longer than the cache).
The model is moved to ai.onnx opset 23 (see ``_model.bump_onnx_opset``).
"""

from __future__ import annotations

import onnx_ir as ir

from rope_export.passes._lowering import LowerRotary, RotarySite, cast_if
from rope_export.passes._model import bump_onnx_opset

OPSET = 23


class LowerToOnnx(LowerRotary):
    target = "onnx"

    def check_site(self, site: RotarySite) -> None:
        if site.x_dtype == ir.DataType.BFLOAT16:
            self.log.note(
                "bfloat16 RotaryEmbedding-23 runs on TensorRT and onnx.reference but onnxruntime's CPU provider has "
                "no kernel for it; for onnxruntime CPU lower with --target decomposed"
            )

    def emit(self, op, site: RotarySite) -> ir.Value:
        attrs = site.attrs.as_onnx_attributes()
        name = site.node.name or None
        if site.position_ids is not None and not self.guard_positions:
            cos = cast_if(op, site.cos, site.cache_dtype, site.x_dtype)
            sin = cast_if(op, site.sin, site.cache_dtype, site.x_dtype)
            return op.RotaryEmbedding(site.x, cos, sin, site.position_ids, _name=name, **attrs)
        cos, sin = self.per_token(op, site, site.x_dtype)
        return op.RotaryEmbedding(site.x, cos, sin, _name=name, **attrs)

    @classmethod
    def prepare(cls, model: ir.Model) -> ir.Model:
        return bump_onnx_opset(model, OPSET)
