"""Fusion rule: interleaved RoPE written pair by pair,
``stack((x1*c - x2*s, x1*s + x2*c), -1).flatten(-2)`` with ``x1, x2 = x[..., 0::2], x[..., 1::2]``.

This is the Meta-style complex rotation once written in real arithmetic (the common way to export
it, ONNX having no complex type), and rope_export's own decomposed interleaved mode; c, s are the
half-width cos/sin. Variants as for the other rules.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from rope_export.passes._fusing import pairs_math, rule_variants
from rope_export.passes.fuse_interleaved import FuseInterleaved


class FusePairsInterleaved(FuseInterleaved):
    """Same channels and checks as FuseInterleaved; only the arithmetic on the pairs differs."""

    variant_tag = " pairs"
    dup = None
    flat = "core"

    def core(self, op, x, cos, sin):
        x1 = self._slice(op, x, "even")
        x2 = self._slice(op, x, "odd")
        y1, y2 = pairs_math(op, x1, x2, cos, sin)
        a = op.Unsqueeze(y1, pattern.Var("unsq_a", can_match_none=True), _outputs=["first_u"])
        b = op.Unsqueeze(y2, pattern.Var("unsq_b", can_match_none=True), _outputs=["second_u"])
        stacked = op.Concat(a, b, _outputs=["stacked"])
        return op.Reshape(stacked, pattern.Var("flat_shape"), _outputs=["core"])


def rules(report, memo) -> list[pattern.RewriteRule]:
    return rule_variants(FusePairsInterleaved, report, memo)
