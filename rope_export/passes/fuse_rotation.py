"""Fusion rule: a rotation written full width, ``x * cos ± r * sin`` with ``r`` x's channels moved.

``r`` is any data movement of x (Slice, Gather, Split, Reshape, Transpose, Concat, Neg, Cast):
transformers' ``rotate_half`` (``cat(-x2, x1)``), its sign-flipped twin ``cat(x2, -x1)``
(NanoChat), GPT-J's ``rotate_every_two`` (``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``),
einops' ``rearrange`` + ``unbind`` + ``stack((-x2, x1))``; cos/sin are duplicated to the full
width (``cat(c, c)``, ``repeat_interleave``, ``repeat(..., r=2)``). Which pairs rotate, the width,
the sign and the layout are read by running the ops (``_site.classify``), never from the spelling;
the site is verified against the op contract before it becomes one rope_export::RotaryEmbedding.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from rope_export.passes._fuse_base import FuseRotary, NotASite, rule_variants
from rope_export.passes._site import Candidate, SkipSite, cast_chain, data_movement_leaves


class FuseRotation(FuseRotary):
    def __init__(self, report, memo, partial: bool = False, upcast: bool = False, subtract: bool = False):
        self.subtract = subtract
        super().__init__(report, memo, partial, upcast, variant="-sub" if subtract else "")

    def core(self, op):
        first = op.Mul(pattern.Var("p0"), pattern.Var("p1"), _outputs=["m0"])
        second = op.Mul(pattern.Var("p2"), pattern.Var("p3"), _outputs=["m1"])
        return (op.Sub if self.subtract else op.Add)(first, second, _outputs=["core"])

    def candidate(self, probe, b: dict) -> Candidate:
        products = [((b["p0"], b["p1"]), b["m0"]), ((b["p2"], b["p3"]), b["m1"])]
        orders = [products] if self.subtract else [products, products[::-1]]  # x * cos first in a difference
        for (with_x, x_product), (with_r, _) in orders:
            for x, cos in (with_x, with_x[::-1]):
                chain = cast_chain(x)
                for r, sin in (with_r, with_r[::-1]):
                    if r in chain:
                        continue
                    leaves = data_movement_leaves(r, set(chain))
                    if leaves and leaves <= set(chain):
                        source = max(leaves | {x}, key=chain.index)  # the furthest up the cast chain
                        return Candidate(b["core"], source, x, cos, sin, x_product, pairs=False)
        self._refuse_scaled(b)
        raise NotASite("neither product holds the other's tensor with its channels moved")

    @staticmethod
    def _refuse_scaled(b: dict) -> None:
        """``x * cos * scale + r(x) * sin * scale`` (xPos): found, named, and left alone."""
        f0, f1 = _factors(b["m0"]), _factors(b["m1"])
        if len(f0) + len(f1) <= 4:
            return
        for xs, rs in ((f0, f1), (f1, f0)):
            for x in xs:
                chain = cast_chain(x)
                for r in rs:
                    leaves = data_movement_leaves(r, set(chain)) if r not in chain else set()
                    if leaves and leaves <= set(chain):
                        raise SkipSite(f"each term carries an extra factor ({len(f0)} and {len(f1)} factors): an "
                                       "xPos-style scaled rotation is not plain RoPE; left decomposed")


def _factors(value, depth: int = 3) -> list:
    node = value.producer()
    if depth and node is not None and node.op_type == "Mul" and node.domain in ("", "ai.onnx"):
        return _factors(node.inputs[0], depth - 1) + _factors(node.inputs[1], depth - 1)
    return [value]


def rules(report, memo) -> list:
    return [variant for subtract in (False, True)
            for variant in rule_variants(FuseRotation, report, memo, substage=1, subtract=subtract)]
