"""Exported test files, made once per session and shared by the export, passes and check tests.

Every preset is scaled down (4 heads, hidden 64, same head_dim and RoPE) with a 64-row cache, so
an export takes a few seconds.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import torch

from rope_export.exporting.core import DTYPES, INPUT_NAMES
from rope_export.presets import load_preset
from rope_export.presets.export import export
from rope_export.runtimes.contract_runners import to_numpy

CACHE_LEN = 64


@functools.cache
def exported_model(preset_name: str, dtype: str = "fp32", decode: bool = True) -> onnx.ModelProto:
    """The exported file (treat as read-only: copy before mutating)."""
    return export(load_preset(preset_name).scaled_down(), dtype=dtype, decode=decode, cache_len=CACHE_LEN).model


def test_block(preset_name: str, dtype: str = "fp32") -> torch.nn.Module:
    """The PyTorch block with the same weights as ``exported_model`` (same seed)."""
    return load_preset(preset_name).scaled_down().build_block(DTYPES[dtype], cache_len=CACHE_LEN)


test_block.__test__ = False  # a helper, not a pytest test


def feeds(inputs: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
    return dict(zip(INPUT_NAMES, (to_numpy(t) for t in inputs), strict=False))
