"""Fusion rule: interleaved RoPE (GPT-J / Meta pairs), ``x * cos + rotate_every_two(x) * sin``.

``rotate_every_two(x) = stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)`` as torch.onnx writes
it: two step-2 Slices, Neg, two Unsqueeze(-1), Concat(-1), Reshape; cos/sin are
``repeat_interleave(c, 2, -1)``. GPT-J rotates [B, S, H, D] tensors before its transpose and its
rotary_dim is partial (the partial variant). Each site becomes one rope_export::RotaryEmbedding
with ``interleaved=1``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.passes._fusing import (
    FuseRotary,
    SkipSite,
    check_flatten_pairs,
    check_stack_pairs,
    rule_variants,
    slice_bounds,
)
from rope_export.passes._values import dim, last_element


class FuseInterleaved(FuseRotary):
    form = "interleaved"
    dup = "repeat"
    flat = "flat"  # the bound value holding the pairs flattened back to the rotated width

    def core(self, op, x, cos, sin):
        even = self._slice(op, x, "even")
        odd = self._slice(op, x, "odd")
        a = op.Unsqueeze(op.Neg(odd), pattern.Var("unsq_a", can_match_none=True), _outputs=["first_u"])
        b = op.Unsqueeze(even, pattern.Var("unsq_b", can_match_none=True), _outputs=["second_u"])
        stacked = op.Concat(a, b, _outputs=["stacked"])
        rotated = op.Reshape(stacked, pattern.Var("flat_shape"), _outputs=["flat"])
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin), _outputs=["core"])

    def width_from_pattern(self, rank: int, bindings: dict) -> int | None:
        width = dim(bindings[self.flat], -1)
        if width is None:
            last = last_element(bindings["flat_shape"])
            width = last if last is not None and last > 0 else None
        return width

    def check_rotation(self, x: ir.Value, rank: int, width: int, bindings: dict, known: dict) -> None:
        even = slice_bounds(list(bindings["even_out"].producer().inputs), rank, known)
        odd = slice_bounds(list(bindings["odd_out"].producer().inputs), rank, known)
        if even is None or odd is None:
            raise SkipSite("the even/odd channels are not constant Slices of the last axis")
        if even[0] != 0 or odd[0] != 1 or even[2] != 2 or odd[2] != 2 or min(even[1], odd[1]) < width:
            raise SkipSite(f"the Slices {even} / {odd} do not take the even and odd channels of {width}")
        check_stack_pairs(bindings, rank)
        check_flatten_pairs(dict(bindings, flat=bindings[self.flat]), rank, width)


def rules(report, memo) -> list[pattern.RewriteRule]:
    return rule_variants(FuseInterleaved, report, memo)
