"""Fusion rule: rotate-half RoPE, ``x * cos + cat(-x[..., h:], x[..., :h]) * sin``.

This is ``apply_rotary_pos_emb`` of Hugging Face Llama, Mistral, Qwen2, Phi, GPT-NeoX and most
others, as torch.onnx writes it (dynamo and TorchScript exporters); cos/sin are ``cat(c, c)``.
Variants (``_fusing.rule_variants``): the partial form of Phi and GPT-NeoX,
``cat(rope(q[..., :rd]), q[..., rd:])``, and the same computed in float32 under a half q.
Each site becomes one rope_export::RotaryEmbedding with ``interleaved=0``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.passes._fusing import FuseRotary, SkipSite, concat_on_last, rule_variants, slice_bounds


class FuseRotateHalf(FuseRotary):
    form = "rotate-half"
    dup = "cat"
    joined = "rotated"  # the bound value where the two halves are concatenated
    joined_what = "cat(-x2, x1)"

    def core(self, op, x, cos, sin):
        x1 = self._slice(op, x, "lo")
        x2 = self._slice(op, x, "hi")
        rotated = op.Concat(op.Neg(x2), x1, _outputs=["rotated"])
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin), _outputs=["core"])

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
        if not concat_on_last(bindings[self.joined].producer(), rank):
            raise SkipSite(f"{self.joined_what} is not on the last axis")


def rules(report, memo) -> list[pattern.RewriteRule]:
    return rule_variants(FuseRotateHalf, report, memo)
