"""The rotary kernels' own code, run where the tensors are: the one entry that picks the backend.

CUDA tensors run on the CUDA kernels (``rope_export.kernels.cuda``, librope_export_cuda.so, PyTorch's
current stream); CPU tensors run on the kernels' CPU twin (``rope_export.kernels.cpu_twin``,
librope_export_twin.so). Both return ``(output, launch plan)`` and plan the same launch, so a test
can hold one against the other. The two bindings stay independent of each other; this module is
the only one that knows both.
"""

from __future__ import annotations

import torch

from rope_export.kernels import cpu_twin
from rope_export.kernels.cpu_twin import TwinPlan


def run(x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, position_ids: torch.Tensor | None = None,
        **kwargs) -> tuple[torch.Tensor, TwinPlan]:
    """``rope_export.kernels.cuda.rotary_embedding`` for CUDA tensors, ``rope_export.kernels.cpu_twin.run`` for CPU
    ones; keyword arguments as theirs (``blocks=`` is the twin's only)."""
    if x.device.type == "cuda":
        from rope_export.kernels import cuda  # here: importing it registers PyTorch's CUDA kernel for the op

        return cuda.rotary_embedding(x, cos_cache, sin_cache, position_ids, **kwargs)
    return cpu_twin.run(x, cos_cache, sin_cache, position_ids, **kwargs)
