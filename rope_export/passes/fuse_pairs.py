"""Fusion rule: a rotation written pair by pair, ``(a*c - b*s, a*s + b*c)`` joined back.

``a`` and ``b`` are the two members of each pair, taken from one tensor by data movement: the
halves (rotate-half), ``x[..., 0::2]``/``x[..., 1::2]``, or a reshape to ``[..., d/2, 2]`` and a
select (torchtune) or a keepdim slice (Meta's complex product as torch.onnx writes it); ``c``/``s``
hold one cos/sin per pair. Joins: ``cat`` (halves, concatenated), ``stack`` (Unsqueeze + Concat +
Reshape: ``stack(..., -1).flatten(-2)``) and ``keepdim`` (Concat of ``[..., 1]`` pairs + Reshape).
``flipped`` is the rotation by -angle, ``(a*c + b*s, b*c - a*s)``. What the pairs are, the sign
and the layout are read by running the ops (``_site.classify``); every site is verified against
the op contract before it becomes one rope_export::RotaryEmbedding.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from rope_export.passes._fuse_base import FuseRotary, NotASite, rule_variants
from rope_export.passes._site import Candidate, climb_to_shape, common_source

JOINS = ("stack", "keepdim", "cat")


class FusePairs(FuseRotary):
    spelling = "pairs"

    def __init__(self, report, memo, partial: bool = False, upcast: bool = False, join: str = "cat",
                 flipped: bool = False):
        self.join, self.flipped = join, flipped
        super().__init__(report, memo, partial, upcast, variant=f"-{join}" + ("-flipped" if flipped else ""))

    def core(self, op):
        def product(tag):
            return op.Mul(pattern.Var(f"{tag}0"), pattern.Var(f"{tag}1"), _outputs=[tag])

        first, second = (op.Add, op.Sub) if self.flipped else (op.Sub, op.Add)
        y1 = first(product("a"), product("b"), _outputs=["y1"])
        y2 = second(product("c"), product("d"), _outputs=["y2"])
        if self.join == "cat":
            return op.Concat(y1, y2, _outputs=["core"])
        if self.join == "stack":
            y1 = op.Unsqueeze(y1, pattern.Var("unsq_a", can_match_none=True))
            y2 = op.Unsqueeze(y2, pattern.Var("unsq_b", can_match_none=True))
        return op.Reshape(op.Concat(y1, y2, _outputs=["stacked"]), pattern.Var("flat_shape"), _outputs=["core"])

    def candidate(self, probe, b: dict) -> Candidate:
        first, second = (b["a0"], b["a1"]), (b["b0"], b["b1"])
        others = {frozenset((b["c0"], b["c1"])), frozenset((b["d0"], b["d1"]))}
        for a, c in (first, first[::-1]):
            for bb, s in (second, second[::-1]):
                if others != {frozenset((a, s)), frozenset((bb, c))}:
                    continue
                source = common_source([a, bb])
                if source is None:
                    continue
                x = climb_to_shape(probe, source, b["core"])
                if x is not None:
                    return Candidate(b["core"], x, x, c, s, b["a"], pairs=True)
                if _rank(source) is not None and _rank(source) == (_rank(b["core"]) or 0) + 1:
                    return Candidate(b["core"], source, b["core"], c, s, b["a"], pairs=True, flatten_source=True)
        raise NotASite("the products are not the pairs of one tensor times cos/sin")


def _rank(value) -> int | None:
    return value.shape.rank() if value.shape is not None else None


def rules(report, memo) -> list:
    return [variant for join in JOINS for flipped in (False, True)
            for variant in rule_variants(FusePairs, report, memo, substage=0 if join != "cat" else 1, join=join,
                                         flipped=flipped)]
