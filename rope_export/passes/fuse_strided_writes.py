"""Fusion rule: a rotation of pairs written into a buffer by strided slices.

``out = torch.empty_like(x); out[..., 0::2] = x1*c - x2*s; out[..., 1::2] = x1*s + x2*c`` (Wan's attention
processor; any code that assigns the two members of each pair to alternate channels) reaches ONNX as two
writes, one per member: torch.onnx writes ``slice_scatter`` as a ScatterND along the first axis, the written
axis moved there and back by Transposes (``Transpose(ScatterND(Transpose(buffer), idx, Transpose(y)))``),
and its optimizer merges the Transposes between and after the writes with their neighbours. The pattern is
the second write; the rule follows data movement from it to the first write and to the buffer (Transposes
only: their composition says how the written tensor's axes are permuted, ``Candidate.y_perm``), and from each
write's updates to its sum of two products, which it hands to ``fuse_pairs``' reading of the pairs. Where
each member lands, that the writes cover every channel, the sign and the layout are read by running the ops
(``_site.classify``), never from the indices; the site is verified against the op contract before it becomes
one rope_export::RotaryEmbedding (transposed as the writes were).
"""

from __future__ import annotations

from dataclasses import replace

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.passes._fuse_base import FuseRotary, NotASite, rule_variants
from rope_export.passes._site import MOVERS, Candidate
from rope_export.passes.fuse_pairs import FusePairs

MAX_MOVES = 8  # data movement between a write and what it writes


class FuseStridedWrites(FusePairs):
    spelling = "pairs written by strided slices"

    def __init__(self, report, memo, partial: bool = False, upcast: bool = False):
        FuseRotary.__init__(self, report, memo, partial, upcast)

    def core(self, op):
        return op.ScatterND(pattern.Var("written"), pattern.Var("indices"), pattern.Var("updates"), _outputs=["core"])

    def candidate(self, probe, b: dict) -> Candidate:
        last = b["core"].producer()
        first, second_perm = _transposed_from(last.inputs[0])
        if first is None or first.producer() is None or first.producer().op_type != "ScatterND":
            raise NotASite("not the second of two writes into one buffer")
        buffer, first_perm = _transposed_from(first.producer().inputs[0])
        if buffer is None:
            raise NotASite("the first write's buffer is not a tensor moved by Transposes only")
        first_terms, second_terms = _terms(first.producer().inputs[2]), _terms(last.inputs[2])
        if first_terms is None or second_terms is None:
            raise NotASite("the writes are not sums of two products")
        perm = _compose(first_perm, second_perm)
        for y1, y2 in ((first_terms, second_terms), (second_terms, first_terms)):
            (a0, a1), (b0, b1), (c0, c1), (d0, d1) = (tuple(p.producer().inputs) for p in (*y1, *y2))
            bindings = {"core": buffer, "a": y1[0], "a0": a0, "a1": a1, "b0": b0, "b1": b1, "c0": c0, "c1": c1,
                        "d0": d0, "d1": d1}  # the buffer stands for the rotation's shape and layout
            try:
                found = super().candidate(probe, bindings)
            except NotASite:
                continue
            if found.flatten_source:
                raise NotASite("no value holds the written tensor in the buffer's shape")
            return replace(found, y=b["core"], y_perm=None if perm == tuple(range(len(perm))) else perm)
        raise NotASite("the written products are not the pairs of one tensor times cos/sin")


def _transposed_from(value: ir.Value) -> tuple[ir.Value | None, tuple[int, ...] | None]:
    """(the value ``value`` is moved from by Transposes and Identities, the permutation of its axes: ``value`` is
    ``source.transpose(perm)``), or (None, None) past ``MAX_MOVES`` or at a Transpose without a perm."""
    perm = None
    for _ in range(MAX_MOVES):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in ("Transpose", "Identity"):
            rank = value.shape.rank() if value.shape is not None else None
            if rank is None:
                return None, None
            return value, perm if perm is not None else tuple(range(rank))
        if node.op_type == "Transpose":
            attribute = node.attributes.get("perm")
            if attribute is None:
                return None, None
            inner = tuple(attribute.as_ints())
            perm = inner if perm is None else tuple(inner[i] for i in perm)
        value = node.inputs[0]
    return None, None


def _compose(first: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation of ``x.transpose(first).transpose(then)``."""
    return tuple(first[i] for i in then)


def _moved_from(value: ir.Value) -> ir.Value | None:
    """The value ``value`` is a data movement of (single-input movers only), or None past ``MAX_MOVES``."""
    for _ in range(MAX_MOVES):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in MOVERS \
                or node.op_type == "Concat":
            return value
        value = node.inputs[0]
    return None


def _terms(value: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """The two products of the sum or difference a write's updates are moved from, or None."""
    source = _moved_from(value)
    node = source.producer() if source is not None else None
    if node is None or node.op_type not in ("Add", "Sub") or node.domain not in ("", "ai.onnx"):
        return None
    products = tuple(node.inputs)
    if len(products) != 2 or any(p is None or p.producer() is None or p.producer().op_type != "Mul"
                                 or p.producer().domain not in ("", "ai.onnx") for p in products):
        return None
    return products


def rules(report, memo) -> list:
    return rule_variants(FuseStridedWrites, report, memo, substage=1)
