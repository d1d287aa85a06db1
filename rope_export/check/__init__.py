"""``rope-export check``: prove that a file computes what its reference computes, on every runner.

The package follows polygraphy's split between what is compared and how:

* ``model_file``: the file, opened without its weights and refused early when it cannot be checked;
* ``metadata``: the ``rope_export.*`` metadata, validated field by field;
* ``references``: what the runners are compared with (the preset's PyTorch block, the transformers
  model, another ONNX file, or onnx-reference as the golden), chosen from the file or named;
* ``weights``: which weights the transformers model is rebuilt with (the file's record, else export
  --hf's rule), and a note whenever they are not the file's own;
* ``module_reference``: PyTorch for an ``export_module`` file (the eager outputs it records, or the
  module given to ``check``);
* ``layer_rope``: each rotary node's own RoPE configuration where layer types differ (Gemma 3);
* ``inputs``: feeds generated from the graph (decoder-aware, RoPE stress cases) or the user's own;
* ``runners``: onnx-reference, the CPU twin, onnxruntime CPU/CUDA, TensorRT, each skipped with a reason;
* ``graph`` and ``cache_rows``: every stored cache row compared with the RoPE configuration, and each
  rotary node run alone over every position on every runner;
* ``compare`` and ``report``: error statistics, error by position, JSON/Markdown/PNG;
* ``core``: ``check()`` itself and its ``CheckOptions`` (the command: ``rope_export.cli.check``).
"""

from rope_export.common.lazy import lazy_getattr

# Imported on first use (PEP 562): importing the package does not import torch or onnxruntime.
_EXPORTS = {
    "OutputStats": "compare", "CheckOptions": "core", "compare_output": "compare", "position_buckets": "compare",
    "check": "core", "Case": "inputs", "InputPlan": "inputs", "CheckError": "model_file",
    "CheckReport": "report", "RunnerReport": "report", "print_report": "report", "report_dict": "report",
    "report_markdown": "report", "write_reports": "report", "RUNNERS": "runners",
}


__getattr__ = lazy_getattr("rope_export.check", _EXPORTS)

__all__ = [
    "RUNNERS",
    "Case",
    "CheckError",
    "CheckOptions",
    "CheckReport",
    "InputPlan",
    "OutputStats",
    "RunnerReport",
    "check",
    "compare_output",
    "position_buckets",
    "print_report",
    "report_dict",
    "report_markdown",
    "write_reports",
]
