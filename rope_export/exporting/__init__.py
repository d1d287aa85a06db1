"""The export core the three front ends share (presets, ``export --hf``, ``export_module``): torch.onnx's
program to a checked file with the rotary op, weights streamed; torch.onnx's console output.

The names here import neither torch nor onnx, so that ``rope-export export --help`` answers at once."""

DTYPE_NAMES = ("fp32", "fp16", "bf16")  # rope_export.exporting.core.DTYPES maps them to torch dtypes
MIN_OPSET = 18  # the lowest ai.onnx opset torch's dynamo exporter emits
HF_FALLBACKS = ("auto", "error", "plain", "fuse")  # what export --hf does when the rotary function does not verify
HF_TRACES = ("per-kind", "full")  # how export --hf traces the decoder layers; the first is the default
FACTORY_HELP = (
    "PACKAGE.MODULE:FACTORY or path/to/file.py:FACTORY; FACTORY() returns (module, args), (module, args, "
    "kwargs) or a dict with keys module, args and optionally kwargs, dynamic_shapes, input_names, output_names"
)
