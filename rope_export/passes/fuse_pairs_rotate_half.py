"""Fusion rule: rotate-half RoPE written pair by pair, ``cat(x1*c - x2*s, x1*s + x2*c)``.

x1, x2 are the halves ``x[..., :h]``, ``x[..., h:]``; c, s are the half-width cos/sin (no
duplication needed). This is how the op contract itself reads, and how hand-written exports
(and rope_export's own decomposed mode) often write it. Variants as for the other rules.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from rope_export.passes._fusing import pairs_math, rule_variants
from rope_export.passes.fuse_rotate_half import FuseRotateHalf


class FusePairsRotateHalf(FuseRotateHalf):
    """Same halves and checks as FuseRotateHalf; only the arithmetic between them differs."""

    variant_tag = " pairs"
    dup = None
    joined = "core"
    joined_what = "the two rotated halves"

    def core(self, op, x, cos, sin):
        x1 = self._slice(op, x, "lo")
        x2 = self._slice(op, x, "hi")
        y1, y2 = pairs_math(op, x1, x2, cos, sin)
        return op.Concat(y1, y2, _outputs=["core"])


def rules(report, memo) -> list[pattern.RewriteRule]:
    return rule_variants(FusePairsRotateHalf, report, memo)
