"""``lower(model, target)``: replace every rope_export::RotaryEmbedding node by a target's form.

One registry, ``TARGETS``: adding a target is adding a rule file and an entry here.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.nodes import all_nodes, is_ours
from rope_export.passes import validation
from rope_export.passes._lower_base import LoweringLog, LowerRotary
from rope_export.passes._model import (
    PassError,
    drop_unused_opsets,
    from_ir,
    infer_shapes,
    to_ir,
)
from rope_export.passes.lower_decomposed import LowerToDecomposed
from rope_export.passes.lower_onnx import LowerToOnnx
from rope_export.passes.lower_ort import LowerToOrt
from rope_export.passes.lower_trt_plugin import LowerToTrtPlugin, raise_trt_plugin_nodes

TARGETS: dict[str, type[LowerRotary]] = {
    "trt-plugin": LowerToTrtPlugin,
    "onnx": LowerToOnnx,
    "ort": LowerToOrt,
    "decomposed": LowerToDecomposed,
}



def _custom_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in all_nodes(model) if is_ours(n)]


def lower(model, target: str, *, guard_positions: bool = True, log: LoweringLog | None = None,
          validate: bool = False):
    """Lower every rope_export::RotaryEmbedding node of ``model`` to ``target``.

    Nodes already in the trt-plugin form (op type RopeExportRotaryEmbedding, or RotaryEmbedding from
    before the rename, in domain trt.plugins with plugin_namespace rope_export) count as that op.

    ``model``: an onnx.ModelProto (returned as a new ModelProto), an onnx_ir.Model (lowered in
    place and returned; use the return value, an opset conversion may replace it) or a path.
    ``guard_positions`` (targets onnx and ort): keep the contract's pass-through for positions
    outside the cache by gathering per-token caches in the graph (default); False feeds
    position_ids to the op directly, which is faster but requires in-range positions.
    ``log``: a LoweringLog to receive the lowered node names and notes (e.g. missing kernels).
    ``validate``: also check that cos² + sin² of constant caches is one constant, and afterwards run
    each lowered node once on a small input against the op contract (``passes.validation``;
    ``rope-export lower`` always does). Off by default here because ``check`` lowers files with
    planted cache rows on purpose, to show that it finds them. The caches' stored types and widths
    are checked either way.
    Raises PassError naming the node, the problem and a target that can express it.
    """
    if target not in TARGETS:
        raise PassError(f"unknown target {target!r}; choose one of: {', '.join(TARGETS)}")
    log = log if log is not None else LoweringLog()
    ir_model, kind = to_ir(model)
    # trt-plugin nodes (either op type) are the same op; re-lowering to trt-plugin renames old ones only
    raised = raise_trt_plugin_nodes(ir_model, legacy_only=target == "trt-plugin")
    if raised:
        log.note(f"read {raised} trt-plugin node(s) as {DOMAIN}::{OP_TYPE}")
    if not _custom_nodes(ir_model):
        log.note(f"no {DOMAIN}::{OP_TYPE} node in the model; nothing to lower")
        return from_ir(ir_model, kind)
    rule_class = TARGETS[target]
    ir_model = rule_class.prepare(ir_model)
    infer_shapes(ir_model)
    # planned on the shapes the rule sees: a small input within the node's static sizes (validation.plan)
    runs = []
    if validate:
        runs = validation.plan(ir_model, _custom_nodes(ir_model), out_of_range=guard_positions or target in GUARDED,
                               log=log)
    else:  # the caches' stored types and widths, always: no target can express a float64 or too-wide cache
        for node in _custom_nodes(ir_model):
            validation.check_node(node, magnitude=False)
    rule = rule_class(guard_positions=guard_positions, log=log)
    pattern.RewriteRuleSet([rule.as_rule()]).apply_to_model(ir_model)
    left = _custom_nodes(ir_model)
    if left:
        reasons = "; ".join(f"{label}: {why}" for label, why in log.failures.items()) or "no reason recorded"
        raise PassError(
            f"target {target!r} cannot express {len(left)} {OP_TYPE} node(s): {reasons}. "
            f"Targets: {', '.join(TARGETS)} (decomposed runs anywhere)"
        )
    drop_unused_opsets(ir_model)
    infer_shapes(ir_model)
    if validate:
        runtime = _runtime(target, runs, log)
        if runtime is not None:
            validation.run(ir_model, runs, runtime, target, log)
    return from_ir(ir_model, kind)


GUARDED = ("trt-plugin", "decomposed")  # forms that always keep the pass-through of out-of-range positions


def _runtime(target: str, runs, log: LoweringLog) -> str | None:
    """Where the lowered nodes run once: the runtime the form is written for, where it runs here."""
    if target == "trt-plugin":
        return "reference"  # TensorRT is not here; the node's attributes are what can go wrong
    if not any(run.dtype == "bfloat16" for run in runs):
        return "onnxruntime"
    if target == "ort":
        log.note("not run once after lowering: bfloat16 X under the com.microsoft op runs on neither onnxruntime's "
                 "CPU provider (no bfloat16 kernels) nor onnx.reference (no com.microsoft kernels)")
        return None
    return "reference"  # onnxruntime's CPU provider has no bfloat16 kernels
