"""Where a file runs besides onnxruntime: polygraphy runners for onnx.reference with the op and for the CPU twin,
and TensorRT engines (``rope-export build``) with their optimization profiles."""
