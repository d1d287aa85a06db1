"""The rotary kernels from Python: the CPU twin (``plugin``), the CUDA library and PyTorch's CUDA op (``cuda``),
the backend pick (``backend``) and ``rope-export build-plugin`` (``build``)."""
