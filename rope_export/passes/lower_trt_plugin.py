"""Lowering rule ``trt-plugin``: the node TensorRT's ONNX parser hands to our IPluginV3 plugin.

The parser imports any op it has no importer for through its fallback plugin importer, which looks
the plugin creator up by the node's op_type plus two *string attributes*, ``plugin_version``
(default "1") and ``plugin_namespace`` (default ""), and passes every other attribute to the
creator as a plugin field (onnx-tensorrt ``onnxOpImporters.cpp``, ``FallbackPluginImporter``).
The node domain is not consulted; ``trt.plugins`` is the domain NVIDIA's ModelOpt gives plugin
nodes, and it keeps the extra attributes away from the ``rope_export`` schema so that onnx.checker
still passes. Inputs stay as they are (the plugin implements the whole contract: float32 caches
under half X, pass-through for out-of-range positions).
"""

from __future__ import annotations

import onnx_ir as ir

from rope_export.passes._lowering import LowerRotary, RotarySite

TRT_PLUGIN_DOMAIN = "trt.plugins"
PLUGIN_NAME = "RotaryEmbedding"
PLUGIN_NAMESPACE = "rope_export"
PLUGIN_VERSION = "1"


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
