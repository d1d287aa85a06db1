"""The lowering targets' names and what each is for, without onnx or onnxscript: the CLI's help reads them.

``lowering.TARGETS`` maps the same names to their rules (a test keeps the two in step)."""

from __future__ import annotations

# The trt-plugin node's routing: what TensorRT's parser looks the plugin creator up by (also read by
# rope-export build, which must not import the passes to say so in --help)
PLUGIN_NAME = "RopeExportRotaryEmbedding"  # the plugin's op_type: one no TensorRT importer claims
TRT_PLUGIN_DOMAIN = "trt.plugins"
LEGACY_PLUGIN_NAME = "RotaryEmbedding"  # before the rename; TensorRT >= 10.15 claims it
PLUGIN_NAMESPACE = "rope_export"
PLUGIN_VERSION = "1"

TARGET_HELP = {
    "trt-plugin": f"{PLUGIN_NAME} for TensorRT with the rope_export plugin library loaded",
    "onnx": "ai.onnx RotaryEmbedding-23 (onnxruntime CPU/CUDA, TensorRT >= 10.15, onnx.reference)",
    "ort": "com.microsoft RotaryEmbedding (onnxruntime CPU/CUDA/DML/WebGPU)",
    "decomposed": "primitive ops only (runs anywhere)",
}
