"""The lowering targets' names and what each is for, without onnx or onnxscript: the CLI's help reads them.

``lowering.TARGETS`` maps the same names to their rules (a test keeps the two in step)."""

from __future__ import annotations

from rope_export.op.nodes import PLUGIN_NAME  # the node identities live with the op

TARGET_HELP = {
    "trt-plugin": f"{PLUGIN_NAME} for TensorRT with the rope_export plugin library loaded",
    "onnx": "ai.onnx RotaryEmbedding-23 (onnxruntime CPU/CUDA, TensorRT >= 10.15, onnx.reference)",
    "ort": "com.microsoft RotaryEmbedding (onnxruntime CPU/CUDA/DML/WebGPU)",
    "decomposed": "primitive ops only (runs anywhere)",
}
