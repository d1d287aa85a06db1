"""``fuse(model)``: decomposed RoPE in other exporters' ONNX files -> rope_export::RotaryEmbedding.

Three passes of onnxscript rewrite rules (each with ``commute=True``, so the operand order of
Add/Mul does not matter): first the partial forms (rotated head + untouched tail + Concat), then
the forms computed in float32 under a half-precision tensor (Cast up, rotate, Cast down), then the
plain forms. Then dead nodes are removed and shapes re-inferred. Nothing else in the file changes: graph
inputs, outputs and the names of the rotated tensors stay as they were.

With ``adopt_standard=True``, ai.onnx RotaryEmbedding-23 nodes (torch.onnx's dynamo exporter makes
them at opset >= 23) are adopted too: renamed to rope_export::RotaryEmbedding, same inputs and
attributes (``fuse_standard_op``). Other rotary ops (com.microsoft) are reported and kept.

Behaviour change to know about: where cos/sin came from ``Gather(table, position_ids)``, a position
outside the table now passes its token through (the op contract) where the original graph failed
(onnxruntime) or, for negative ids, read a row from the end.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.contract import DOMAIN, OP_TYPE, OP_VERSION
from rope_export.passes import (
    fuse_interleaved,
    fuse_pairs_interleaved,
    fuse_pairs_rotate_half,
    fuse_rotate_half,
    fuse_standard_op,
)
from rope_export.passes._fusing import STAGES, FusionReport
from rope_export.passes._model import PassError, from_ir, infer_shapes, onnx_opset, remove_unused, to_ir

MIN_OPSET = 13
RULE_MODULES = (fuse_rotate_half, fuse_interleaved, fuse_pairs_rotate_half, fuse_pairs_interleaved, fuse_standard_op)


def fuse(model, *, report: FusionReport | None = None, adopt_standard: bool = False):
    """Replace each decomposed RoPE site of ``model`` by one rope_export::RotaryEmbedding node.

    ``model``: onnx.ModelProto (a new ModelProto is returned), onnx_ir.Model (changed in place and
    returned) or a path. ``report``: a FusionReport that receives one row per site seen.
    ``adopt_standard``: also rename ai.onnx RotaryEmbedding-23 nodes to rope_export's (same
    semantics); by default they are reported and kept.
    """
    report = report if report is not None else FusionReport()
    ir_model, kind = to_ir(model)
    opset = onnx_opset(ir_model)
    if opset is not None and opset < MIN_OPSET:
        raise PassError(
            f"the model imports ai.onnx opset {opset}; fusion writes ops of opset >= {MIN_OPSET} (Unsqueeze with an "
            f"axes input); convert it first with onnx.version_converter.convert_version(model, {MIN_OPSET})"
        )
    for node in ir.traversal.RecursiveGraphIterator(ir_model.graph):
        if node.op_type == OP_TYPE and node.outputs[0].name:
            if node.domain == DOMAIN:
                report.seen(node.outputs[0].name, "already fused", "", f"{DOMAIN}::{OP_TYPE}")
            else:
                hint = " (adopt_standard / --adopt-standard renames it)" if node.domain in ("", "ai.onnx") else ""
                report.seen(node.outputs[0].name, "other rotary op", f"{node.domain or 'ai.onnx'}::{OP_TYPE}",
                            "kept as is" + hint)
    infer_shapes(ir_model)
    fused = 0
    for stage in range(STAGES):
        memo: dict = {}
        rules = [rule for module in RULE_MODULES for st, rule in module.rules(report, memo)
                 if st == stage and (adopt_standard or module is not fuse_standard_op)]
        fused += pattern.RewriteRuleSet(rules, commute=True).apply_to_model(ir_model)
    if fused:
        ir_model.opset_imports.setdefault(DOMAIN, OP_VERSION)
        remove_unused(ir_model)
        infer_shapes(ir_model)
    return from_ir(ir_model, kind)
