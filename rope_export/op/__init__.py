"""The rotary op and its references: the contract, the PyTorch and NumPy/onnx.reference forms, the torch custom
op, the rope-type registry and the tolerances every comparison uses. Imports nothing above it."""
