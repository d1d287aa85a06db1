"""Fusion rule: interleaved RoPE written pair by pair,
``stack((x1*c - x2*s, x1*s + x2*c), -1).flatten(-2)`` with ``x1, x2 = x[..., 0::2], x[..., 1::2]``.

This is the Meta-style complex rotation once written in real arithmetic (the common way to export
it, ONNX having no complex type), and rope_export's own decomposed interleaved mode; c, s are the
half-width cos/sin. Variants as for the other rules.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.passes._fusing import (
    FuseRotary,
    SkipSite,
    check_flatten_pairs,
    check_stack_pairs,
    pairs_math,
    rule_variants,
    slice_bounds,
)
from rope_export.passes._values import dim, last_element


class FusePairsInterleaved(FuseRotary):
    form = "interleaved"
    variant_tag = " pairs"
    dup = None

    def core(self, op, x, cos, sin):
        x1 = self._slice(op, x, "even")
        x2 = self._slice(op, x, "odd")
        y1, y2 = pairs_math(op, x1, x2, cos, sin)
        a = op.Unsqueeze(y1, pattern.Var("unsq_a", can_match_none=True), _outputs=["first_u"])
        b = op.Unsqueeze(y2, pattern.Var("unsq_b", can_match_none=True), _outputs=["second_u"])
        stacked = op.Concat(a, b, _outputs=["stacked"])
        return op.Reshape(stacked, pattern.Var("flat_shape"), _outputs=["core"])

    def width_from_pattern(self, rank: int, bindings: dict) -> int | None:
        width = dim(bindings["core"], -1)
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
        bindings = dict(bindings, flat=bindings["core"])
        check_flatten_pairs(bindings, rank, width)


def rules(report, memo) -> list[pattern.RewriteRule]:
    return rule_variants(FusePairsInterleaved, report, memo)
