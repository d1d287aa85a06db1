"""Lowering rule ``decomposed``: primitive ai.onnx ops only (Gather, Where, Slice, Reshape, Mul, ...).

No SplitToSequence (TensorRT rejects it), no custom or contrib op, so the result runs anywhere,
bfloat16 included wherever the primitive ops do. It follows the contract exactly: per-token caches
gathered with clamped positions, arithmetic in float32 whatever the storage type, one rounding
back to X's type, and ``Where(valid, y, x)`` on the two rotated halves so out-of-range tokens pass
through bit for bit (the tail channels are copied for every token anyway).
``guard_positions`` does not apply: the guard is always there (the gather needs the clamp anyway).

X is viewed as [B, S, H, D] (3-D input, reshaped; with the static head size, not -1, so batch 0 or
seq 0 reshape too) or used as [B, H, S, D] (4-D); cos/sin get a broadcast axis at the head
position. Rotate-half pairs channel i with i + rd/2 through two Slices;
interleaved pairs (2i, 2i + 1) through a [..., rd/2, 2] view.
"""

from __future__ import annotations

import onnx_ir as ir

from rope_export.passes._lower_base import (
    LowerRotary,
    RotarySite,
    SiteError,
    cast_if,
    const,
    pass_through,
)
from rope_export.passes._model import require_onnx_opset
from rope_export.passes._values import INT64_MAX

F32 = ir.DataType.FLOAT


class LowerToDecomposed(LowerRotary):
    target = "decomposed"

    def check_site(self, site: RotarySite) -> None:
        if site.rotary_dim is None:
            raise SiteError(
                "the decomposed target needs the rotated width: set rotary_embedding_dim, or give X a static head "
                "dimension or the caches a static last dimension (run onnx.shape_inference.infer_shapes)"
            )

    def emit(self, op, site: RotarySite) -> ir.Value:
        rd, half = site.rotary_dim, site.half
        cos, sin = self.per_token(op, site, F32)  # [B, S, rd/2] float32
        head = site.head_dim or -1  # -1 cannot be inferred when B*S is 0; a static head size can
        if site.rank == 3:
            xv = op.Reshape(site.x, const(op, [0, 0, site.heads, head]))  # [B, S, H, D]
            head_axis, token_axes = 2, (0, 1)
        else:
            xv, head_axis, token_axes = site.x, 1, (0, 2)  # [B, H, S, D]
        cos = op.Unsqueeze(cos, const(op, [head_axis]))
        sin = op.Unsqueeze(sin, const(op, [head_axis]))
        last = const(op, [3])
        partial = site.partial
        x_rot = op.Slice(xv, const(op, [0]), const(op, [rd]), last) if partial else xv

        if site.attrs.interleaved:
            pairs = op.Reshape(x_rot, const(op, [0, 0, 0, half, 2]))  # [..., rd/2, 2]
            axis = const(op, [4])
            x1 = op.Slice(pairs, const(op, [0]), const(op, [1]), axis)
            x2 = op.Slice(pairs, const(op, [1]), const(op, [2]), axis)
            cos, sin = op.Unsqueeze(cos, axis), op.Unsqueeze(sin, axis)
        else:
            x1 = op.Slice(x_rot, const(op, [0]), const(op, [half]), last)
            x2 = op.Slice(x_rot, const(op, [half]), const(op, [rd]), last)
        f1 = cast_if(op, x1, site.x_dtype, F32)
        f2 = cast_if(op, x2, site.x_dtype, F32)
        y1 = op.Sub(op.Mul(f1, cos), op.Mul(f2, sin))
        y2 = op.Add(op.Mul(f1, sin), op.Mul(f2, cos))
        # One rounding to X's type, then X's own bits for out-of-range tokens (a select in X's type).
        valid, rank = self.validity(op, site), 5 if site.attrs.interleaved else 4
        y1 = pass_through(op, valid, cast_if(op, y1, F32, site.x_dtype), x1, token_axes, rank)
        y2 = pass_through(op, valid, cast_if(op, y2, F32, site.x_dtype), x2, token_axes, rank)
        if site.attrs.interleaved:
            rotated = op.Reshape(op.Concat(y1, y2, axis=4), const(op, [0, 0, 0, rd]))
        else:
            rotated = op.Concat(y1, y2, axis=3)
        if partial:
            rest = op.Slice(xv, const(op, [rd]), const(op, [INT64_MAX]), last)
            rotated = op.Concat(rotated, rest, axis=3)
        if site.rank == 3:
            hidden = site.heads * site.head_dim if site.head_dim else -1
            return op.Reshape(rotated, const(op, [0, 0, hidden]), _name=site.node.name or None)
        return rotated

    @classmethod
    def prepare(cls, model: ir.Model) -> ir.Model:
        require_onnx_opset(model, 13, "the decomposed lowering")
        return model
