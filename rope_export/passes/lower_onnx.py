"""Lowering rule ``onnx``: the standard ``ai.onnx`` RotaryEmbedding-23.

The standard op needs caches of X's type: with float32 caches under float16/bfloat16 X it runs in
float32 between two Casts of X, as the contract computes (see ``_lower_base.math_dtype``).
It has no pass-through for out-of-range positions (onnxruntime's CPU kernel rejects them), so by
default (``guard_positions=True``) the lowering gathers per-token caches itself with clamped
indices, feeds the op without position_ids, and selects X itself for out-of-range tokens
(``Where(valid, Y, X)``, so inf and nan pass through bit for bit). With
``guard_positions=False`` position_ids go straight to the op: faster, but positions must then
lie in [0, max_pos) (onnxruntime's kernel also refuses a sequence longer than the cache).
The model is moved to ai.onnx opset 23 (see ``_model.bump_onnx_opset``).
"""

from __future__ import annotations

import onnx_ir as ir

from rope_export.passes._lower_base import LowerRotary, RotarySite, cast_if, math_dtype
from rope_export.passes._model import bump_onnx_opset

OPSET = 23


class LowerToOnnx(LowerRotary):
    target = "onnx"

    def check_site(self, site: RotarySite) -> None:
        if math_dtype(site) == ir.DataType.BFLOAT16:
            self.log.note(
                "bfloat16 RotaryEmbedding-23 runs on TensorRT and onnx.reference but onnxruntime's CPU provider has "
                "no kernel for it"
            )

    def emit(self, op, site: RotarySite) -> ir.Value:
        attrs = site.attrs.as_onnx_attributes()
        name = site.node.name or None
        dtype = math_dtype(site)
        x = cast_if(op, site.x, site.x_dtype, dtype)
        if site.position_ids is not None and not self.guard_positions:
            cos = cast_if(op, site.cos, site.cache_dtype, dtype)
            sin = cast_if(op, site.sin, site.cache_dtype, dtype)
            y = op.RotaryEmbedding(x, cos, sin, site.position_ids, _name=name, **attrs)
            return cast_if(op, y, dtype, site.x_dtype)
        cos, sin = self.per_token(op, site, dtype)
        y = op.RotaryEmbedding(x, cos, sin, _name=name, **attrs)
        return self.select_and_cast(op, site, y, dtype)

    @classmethod
    def prepare(cls, model: ir.Model) -> ir.Model:
        return bump_onnx_opset(model, OPSET)
