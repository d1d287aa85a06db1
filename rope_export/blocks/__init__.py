"""Your own PyTorch module with RoPE to ONNX (``rope_export.export_module``, ``export --module``): the rotations
found and hooked, the export through the shared core, and the file checked on onnxruntime before it is written."""
