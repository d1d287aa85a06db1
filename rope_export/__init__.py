"""rope-export: RoPE attention blocks to ONNX with one rotary op."""
__version__ = "0.1.0"


def __getattr__(name: str):
    # rope_export.export_module(module, args, ...) without importing torch for every CLI command
    if name == "export_module":
        from rope_export.blocks.export import export_module

        return export_module
    raise AttributeError(f"module 'rope_export' has no attribute {name!r}")
