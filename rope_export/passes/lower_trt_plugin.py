"""Lowering rule ``trt-plugin``: the node TensorRT's ONNX parser hands to our IPluginV3 plugin.

The parser imports any op it has no importer for through its fallback plugin importer, which looks
the plugin creator up by the node's op_type plus two *string attributes*, ``plugin_version``
(default "1") and ``plugin_namespace`` (default ""), and passes the attributes the creator declares
(``getFieldNames``) as plugin fields, INT attributes as INT32 x 1 (onnx-tensorrt
``onnxOpImporters.cpp``, ``FallbackPluginImporter`` / ``loadFields``). An op type with a built-in
importer never reaches a plugin: TensorRT >= 10.15 imports ``RotaryEmbedding`` as its own layer
(same-typed caches, no position guard). So the node's op type is ``RopeExportRotaryEmbedding``,
which no importer claims: without our plugin library the parse fails ("Plugin not found") instead
of silently becoming TensorRT's layer.

The node domain is not consulted by the parser; ``trt.plugins`` is the domain NVIDIA's ModelOpt
gives plugin nodes, and it keeps the extra attributes away from the ``rope_export`` schema so that
onnx.checker still passes. Inputs stay as they are (the plugin implements the whole contract:
float32 caches under half X, pass-through for out-of-range positions).

Files lowered before the rename carry op type ``RotaryEmbedding`` in ``trt.plugins``; they are
the same op. ``RaiseTrtPluginNode`` turns either form back into rope_export::RotaryEmbedding, so
``lower`` accepts such files (re-lowering one to ``trt-plugin`` writes the new op type), and
``rope_export.op.nodes`` classifies both, for the runners and ``check``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.op.contract import DOMAIN, OP_TYPE, OP_VERSION
from rope_export.op.nodes import (
    LEGACY_PLUGIN_NAME,
    PLUGIN_NAME,
    PLUGIN_NAMESPACE,
    PLUGIN_OP_TYPES,
    PLUGIN_VERSION,
    TRT_PLUGIN_DOMAIN,
    is_trt_plugin_node,
    string_attribute,
)
from rope_export.passes._lower_base import LowerRotary, RotarySite, SiteError, read_site

ROUTING_ATTRIBUTES = ("plugin_namespace", "plugin_version")


class LowerToTrtPlugin(LowerRotary):
    target = "trt-plugin"

    def emit(self, op, site: RotarySite) -> ir.Value:
        inputs = [site.x, site.cos, site.sin] + ([site.position_ids] if site.position_ids is not None else [])
        return op.op(
            PLUGIN_NAME,
            *inputs,
            _domain=TRT_PLUGIN_DOMAIN,
            _version=1,
            _name=site.node.name or None,
            **site.attrs.as_onnx_attributes(),
            plugin_namespace=PLUGIN_NAMESPACE,
            plugin_version=PLUGIN_VERSION,
        )



class RaiseTrtPluginNode(pattern.RewriteRuleClassBase):
    """A trt-plugin node of ours (``op_type``: the current or the legacy name) -> rope_export::RotaryEmbedding."""

    def __init__(self, op_type: str):
        super().__init__(name=f"raise-trt-plugin-{op_type}")
        self.op_type = op_type

    def pattern(self, op, x, cos, sin):
        position_ids = pattern.Var("position_ids", can_match_none=True)
        return getattr(op, self.op_type)(x, cos, sin, position_ids, _domain=TRT_PLUGIN_DOMAIN, _outputs=["y"])

    def check(self, context, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = y.producer()
        if not is_trt_plugin_node(node.domain, node.op_type, string_attribute(node, "plugin_namespace")):
            return result.fail(f"plugin_namespace is not {PLUGIN_NAMESPACE!r}: another library's plugin", node)
        if string_attribute(node, "plugin_version") not in (None, PLUGIN_VERSION):
            return result.fail(f"plugin_version is not {PLUGIN_VERSION!r}", node)
        try:
            read_site(node)
        except SiteError as exc:
            return result.fail(str(exc), node)
        return result

    def rewrite(self, op, y, **_):
        node = y.producer()
        site = read_site(node)
        inputs = [site.x, site.cos, site.sin] + ([site.position_ids] if site.position_ids is not None else [])
        return op.op(OP_TYPE, *inputs, _domain=DOMAIN, _version=OP_VERSION, _name=node.name or None,
                     **site.attrs.as_onnx_attributes())

    def as_rule(self) -> pattern.RewriteRule:
        return pattern.RewriteRule(self.pattern, self.rewrite, self.check, name=self.name)


def raise_trt_plugin_nodes(model: ir.Model, legacy_only: bool = False) -> int:
    """Turn our trt-plugin nodes back into rope_export::RotaryEmbedding, in place; returns how many.

    ``legacy_only``: only those with the pre-rename op type (lowering to trt-plugin again leaves
    current ones as they are). Nodes of other plugin libraries are left alone.
    """
    op_types = (LEGACY_PLUGIN_NAME,) if legacy_only else PLUGIN_OP_TYPES
    return pattern.RewriteRuleSet([RaiseTrtPluginNode(t).as_rule() for t in op_types]).apply_to_model(model)
