"""The export core the three front ends share (presets, ``export --hf``, ``export_module``): torch.onnx's
program to a checked file with the rotary op, weights streamed; checkpoints; torch.onnx's console output.

The names here import neither torch nor onnx, so that ``rope-export export --help`` answers at once."""

DTYPE_NAMES = ("fp32", "fp16", "bf16")  # rope_export.exporting.core.DTYPES maps them to torch dtypes
MIN_OPSET = 18  # the lowest ai.onnx opset torch's dynamo exporter emits
