"""rope-export: RoPE attention blocks to ONNX with one rotary op."""
__version__ = "0.1.0"
