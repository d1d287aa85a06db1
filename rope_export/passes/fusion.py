"""``fuse(model)``: decomposed RoPE in other exporters' ONNX files -> rope_export::RotaryEmbedding.

Two rules find every spelling of a rotation: ``fuse_rotation`` (full width, ``x * cos ± r * sin``
with ``r`` x's channels moved) and ``fuse_pairs`` (pair by pair, joined back). Their patterns only
find the arithmetic (operand order is handled by the rules, so no commuted copies are needed); what
the site computes is decided by running its ops on probes, and every site is verified numerically
against the op contract before it is rewritten (``_site``, ``_verify``), so a look-alike is left
alone with the reason. Passes run larger forms first: the partial forms (rotated head + untouched
tail + Concat), then the forms computed in float32 under a half-precision tensor (Cast up, rotate,
Cast down), then the plain forms; dead nodes are removed between passes. Nothing else in the file
changes: graph inputs, outputs and the names of the rotated tensors stay as they were, except that a
product multiplied by exactly 1.0 before a sum (``x * cos * 1.0``, kept by TorchScript exports) is
bypassed first (``_unit_scale``: exact, ``x * 1`` is ``x``).

Detection runs on the ONNX graph rather than on torch.export's ATen graph because one mechanism
then serves every producer: ``rope-export fuse`` on anyone's file (TorchScript or dynamo exports,
other tools) and ``rope_export.export_module`` on its own plain export; it sees what torch.onnx
really emitted (complex products already turned into real pairs, its own rotary fusion at opset
23); and a site can be run on its own (``_probe``) without the model's weights, which at real
sizes are never loaded.

With ``adopt_standard=True``, ai.onnx RotaryEmbedding-23 nodes (torch.onnx's dynamo exporter makes
them at opset >= 23) are adopted too: renamed to rope_export::RotaryEmbedding, same inputs and
attributes (``fuse_standard_op``). Other rotary ops (com.microsoft) are reported and kept.

Behaviour change to know about: where cos/sin came from ``Gather(table, position_ids)``, a position
outside the table now passes its token through (the op contract) where the original graph failed
(onnxruntime) or, for negative ids, read a row from the end.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.op.contract import DOMAIN, OP_TYPE, OP_VERSION
from rope_export.op.nodes import CONTRACT_KINDS, STANDARD, is_ours, rotary_kind
from rope_export.passes import evidence, fuse_pairs, fuse_rotation, fuse_standard_op, fuse_strided_writes, validation
from rope_export.passes._fuse_base import STAGES, FusionReport
from rope_export.passes._model import PassError, from_ir, infer_shapes, onnx_opset, remove_unused, to_ir
from rope_export.passes._probe import Probe
from rope_export.passes._unit_scale import drop_unit_scales

MIN_OPSET = 13
RULE_MODULES = (fuse_pairs, fuse_strided_writes, fuse_rotation, fuse_standard_op)


def fuse(model, *, report: FusionReport | None = None, adopt_standard: bool = False, validate: bool = False,
         table_inputs: Iterable[str] = ()):
    """Replace each decomposed RoPE site of ``model`` by one rope_export::RotaryEmbedding node.

    ``model``: onnx.ModelProto (a new ModelProto is returned), onnx_ir.Model (changed in place and
    returned) or a path. ``report``: a FusionReport that receives one row per site seen.
    ``adopt_standard``: also rename ai.onnx RotaryEmbedding-23 nodes to rope_export's (same
    semantics); by default they are reported and kept.
    The report also counts the decomposed rotations before and after from the graph's own evidence
    (``passes.evidence``: cos/sin feeding multiply-add pairs), so a file where rotations stayed
    decomposed says so (``report.summary()``, ``report.complete``).
    ``table_inputs``: names of graph inputs that hold cos/sin tables the caller computes (a pipeline's rotary
    tables, a block's ``position_embeddings``); the numerical check feeds them the cos and sin of one angle per
    pair, so a rotation that reads them is fused and its node reads one value per pair (the graph alone cannot
    show that an input is a table: for anything else fed there the fused file differs). ``export_module`` passes
    the inputs its census found to be tables.
    ``validate``: check every rope_export node of the result (stored cache types and widths, cos² + sin²
    one constant) and run each once on onnx.reference against the op contract in NumPy
    (``passes.validation``; ``rope-export fuse`` always does).
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
        rotary = rotary_kind(node)
        if rotary is None or not node.outputs[0].name:
            continue
        if rotary in CONTRACT_KINDS:
            report.seen(node.outputs[0].name, "already fused", "", f"{node.domain}::{node.op_type}")
        else:
            hint = " (adopt_standard / --adopt-standard renames it)" if rotary == STANDARD else ""
            report.seen(node.outputs[0].name, "other rotary op", f"{node.domain or 'ai.onnx'}::{OP_TYPE}",
                        "kept as is" + hint)
    infer_shapes(ir_model)
    if drop_unit_scales(ir_model.graph):  # x * cos * 1.0 (TorchScript keeps a scale of one): exact to bypass
        remove_unused(ir_model)
    tables = frozenset(table_inputs)
    report.found = evidence.count_rotations(ir_model, tables)
    fused = 0
    # one memo (site analyses, caches) and one set of probe sizes for every stage; the rules are
    # built once (building onnxscript patterns is not free)
    memo: dict = {"probe": Probe(ir_model, tables=tables)}
    staged = [(st, rule) for module in RULE_MODULES for st, rule in module.rules(report, memo)
              if adopt_standard or module is not fuse_standard_op]
    for stage in range(STAGES):
        rules = [rule for st, rule in staged if st == stage]
        count = pattern.RewriteRuleSet(rules).apply_to_model(ir_model)
        if count:
            remove_unused(ir_model)  # a fused site's old nodes must not match a later, smaller pattern
        fused += count
    if fused:
        ir_model.opset_imports.setdefault(DOMAIN, OP_VERSION)
        remove_unused(ir_model)
        infer_shapes(ir_model)
    report.left = evidence.count_rotations(ir_model, tables)
    if validate:
        nodes = [n for n in ir.traversal.RecursiveGraphIterator(ir_model.graph) if is_ours(n)]
        validation.run(ir_model, validation.plan(ir_model, nodes, out_of_range=True), "reference", "fused")
    return from_ir(ir_model, kind)
