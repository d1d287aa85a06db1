"""Files: ONNX models of any size with their external data, tensors streamed to disk.

``EXTERNAL_DATA`` imports nothing, so the command-line options can offer it at once."""

EXTERNAL_DATA = ("auto", "single", "per-tensor", "never")
