"""The rotary op as a torch custom op: ``torch.ops.rope_export.rotary_embedding``.

Eager calls run the reference (rope_export.op.reference); export and torch.compile see an opaque op
with a fake (shape-only) implementation, which the ONNX exporter turns into one
``rope_export::RotaryEmbedding`` node. The blocks call this op, so eager PyTorch and export run
the same code path.
"""

from __future__ import annotations

import torch

from rope_export.op import contract, reference


@torch.library.custom_op(contract.TORCH_OP_NAME, mutates_args=())
def rotary_embedding(
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> torch.Tensor:
    return reference.rotary_embedding(
        x,
        cos_cache,
        sin_cache,
        position_ids,
        interleaved=interleaved,
        num_heads=num_heads,
        rotary_embedding_dim=rotary_embedding_dim,
    )


@rotary_embedding.register_fake
def _(x, cos_cache, sin_cache, position_ids=None, interleaved=False, num_heads=0, rotary_embedding_dim=0):
    return torch.empty_like(x)


# On CUDA tensors the op runs the TensorRT plugin's own kernels (librope_export_cuda.so).
from rope_export.kernels import cuda as _cuda  # noqa: E402 - after the op it registers a kernel for

_cuda.register_torch_kernel(rotary_embedding)
