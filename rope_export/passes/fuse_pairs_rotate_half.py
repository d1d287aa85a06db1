"""Fusion rule: rotate-half RoPE written pair by pair, ``cat(x1*c - x2*s, x1*s + x2*c)``.

x1, x2 are the halves ``x[..., :h]``, ``x[..., h:]``; c, s are the half-width cos/sin (no
duplication needed). This is how the op contract itself reads, and how hand-written exports
(and rope_export's own decomposed mode) often write it. Variants as for the other rules.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.passes._fusing import FuseRotary, SkipSite, concat_on_last, pairs_math, rule_variants, slice_bounds


class FusePairsRotateHalf(FuseRotary):
    form = "rotate-half"
    variant_tag = " pairs"
    dup = None

    def core(self, op, x, cos, sin):
        x1 = self._slice(op, x, "lo")
        x2 = self._slice(op, x, "hi")
        y1, y2 = pairs_math(op, x1, x2, cos, sin)
        return op.Concat(y1, y2, _outputs=["core"])

    def width_from_pattern(self, rank: int, bindings: dict) -> int | None:
        lo = slice_bounds(list(bindings["lo_out"].producer().inputs), rank)
        return None if lo is None or lo[0] != 0 else 2 * lo[1]

    def check_rotation(self, x: ir.Value, rank: int, width: int, bindings: dict, known: dict) -> None:
        half = width // 2
        lo = slice_bounds(list(bindings["lo_out"].producer().inputs), rank, known)
        hi = slice_bounds(list(bindings["hi_out"].producer().inputs), rank, known)
        if lo is None or hi is None:
            raise SkipSite("the two halves are not constant Slices of the last axis")
        if lo != (0, half, 1) or hi[0] != half or hi[2] != 1 or hi[1] < width:
            raise SkipSite(f"the Slices [{lo[0]}:{lo[1]}] / [{hi[0]}:{hi[1]}] do not split {width} channels in halves")
        if not concat_on_last(bindings["core"].producer(), rank):
            raise SkipSite("the two rotated halves are not joined on the last axis")


def rules(report, memo) -> list[pattern.RewriteRule]:
    return rule_variants(FusePairsRotateHalf, report, memo)
