"""The rotary op's node identities in a file, and the one classifier every module asks.

A rotation reaches a file as one of four nodes, named here as ``lower``'s targets name them:

| kind | node | carries the whole contract |
|---|---|---|
| ``rope_export`` | ``rope_export::RotaryEmbedding`` (ours, before lowering) | yes |
| ``trt-plugin`` | our TensorRT plugin's node (``PLUGIN_NAME`` in ``TRT_PLUGIN_DOMAIN``) | yes |
| ``onnx`` | ``ai.onnx`` RotaryEmbedding-23 | no: same-typed caches, no pass-through |
| ``ort`` | ``com.microsoft`` RotaryEmbedding | no |

Works on ``onnx.NodeProto`` and ``onnx_ir.Node`` alike and imports neither (the command line's
``--help`` reads the plugin's names from here).
"""

from __future__ import annotations

from rope_export.op.contract import DOMAIN, OP_TYPE

# The trt-plugin node's routing: what TensorRT's parser looks the plugin creator up by.
PLUGIN_NAME = "RopeExportRotaryEmbedding"  # the plugin's op_type: one no TensorRT importer claims
TRT_PLUGIN_DOMAIN = "trt.plugins"  # ModelOpt's domain for plugin nodes; the parser does not read it
LEGACY_PLUGIN_NAME = "RotaryEmbedding"  # before the rename; TensorRT >= 10.15 claims it, still read
PLUGIN_OP_TYPES = (PLUGIN_NAME, LEGACY_PLUGIN_NAME)
PLUGIN_NAMESPACE = "rope_export"
PLUGIN_VERSION = "1"

STANDARD_DOMAINS = ("", "ai.onnx")  # RotaryEmbedding-23 of the default domain
CONTRIB_DOMAIN = "com.microsoft"  # onnxruntime's contrib RotaryEmbedding

OURS, TRT_PLUGIN, STANDARD, CONTRIB = "rope_export", "trt-plugin", "onnx", "ort"
KINDS = (OURS, TRT_PLUGIN, STANDARD, CONTRIB)
CONTRACT_KINDS = (OURS, TRT_PLUGIN)  # nodes with the contract's extensions (pass-through, fp32 caches)


def is_trt_plugin_node(domain: str, op_type: str, namespace: str | bytes | None) -> bool:
    """A node that targets our plugin: trt.plugins domain, either op type, namespace rope_export."""
    if isinstance(namespace, bytes):
        namespace = namespace.decode(errors="replace")
    return domain == TRT_PLUGIN_DOMAIN and op_type in PLUGIN_OP_TYPES and namespace == PLUGIN_NAMESPACE


def string_attribute(node, name: str) -> str | None:
    """A string attribute of an onnx.NodeProto or an onnx_ir.Node; None when absent or not a string."""
    if hasattr(node, "attributes"):  # onnx_ir.Node
        attr = node.attributes.get(name)
        value = getattr(attr, "value", None)
        return value if isinstance(value, str) else None
    for attr in node.attribute:
        if attr.name == name:
            return attr.s.decode(errors="replace") if attr.s else None
    return None


def rotary_kind(node) -> str | None:
    """Which rotary node ``node`` is (one of ``KINDS``), or None for any other node."""
    if is_trt_plugin_node(node.domain, node.op_type, string_attribute(node, "plugin_namespace")):
        return TRT_PLUGIN
    if node.op_type != OP_TYPE:
        return None
    if node.domain == DOMAIN:
        return OURS
    if node.domain in STANDARD_DOMAINS:
        return STANDARD
    return CONTRIB if node.domain == CONTRIB_DOMAIN else None


def is_ours(node) -> bool:
    """``rope_export::RotaryEmbedding``: what export writes and ``lower`` rewrites."""
    return node.domain == DOMAIN and node.op_type == OP_TYPE


def carries_contract(node) -> bool:
    """Ours or our trt-plugin node: what the CPU twin and onnx.reference with our op run."""
    return rotary_kind(node) in CONTRACT_KINDS


def all_nodes(model):
    """Every node of the main graph, its subgraphs and its local functions; ``model``: an
    onnx.ModelProto or an onnx_ir.Model."""
    if hasattr(model, "opset_imports"):  # onnx_ir.Model
        import onnx_ir as ir

        yield from ir.traversal.RecursiveGraphIterator(model.graph)
        for function in model.functions.values():
            yield from function
        return

    def walk(graph):
        for node in graph.node:
            yield node
            for attr in node.attribute:  # If/Loop/Scan bodies
                for subgraph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from walk(subgraph)

    yield from walk(model.graph)
    for function in model.functions:
        yield from function.node
