"""Constant cos/sin tables (kind 2 of issue 25): blocks that make their tables for the sequence length
(``cache[:S]``, ``arange(S)``, no position input) export with the tables folded into constants; those
are per-token caches all the same. lucidrains' rotary-embedding-torch, 1-D and axial 2-D, through
export_module (static, and batch/sequence dynamic) and through fuse of its plain export: 2 rotary
nodes, the ``onnx`` lowering equal to the eager block on onnxruntime (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import vision_blocks as vb
from test_module_export_vision import assert_equal_to_eager, n_rotary, plain_export

import rope_export
from rope_export.passes import FusionReport, fuse

pytest.importorskip("rotary_embedding_torch")


def x(batch: int = vb.B, tokens: int = vb.N, seed: int = 3) -> tuple[torch.Tensor]:
    return (torch.randn(batch, tokens, vb.HIDDEN, generator=torch.Generator().manual_seed(seed)),)


@pytest.mark.parametrize("dynamic", [None, "auto"], ids=["static", "dynamic"])
def test_rotate_queries_or_keys(dynamic):
    block = vb.lucidrains()
    result = rope_export.export_module(block, x(), dynamic_shapes=dynamic)
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert_equal_to_eager(result.model, block, x())
    if dynamic == "auto":  # the tables are computed in the graph: other batch and sequence lengths run too
        assert_equal_to_eager(result.model, block, x(batch=3, tokens=9, seed=4))
    else:
        assert "constant table" in " ".join(r.detail for r in result.fusion.rows())


def test_axial_pixel_frequencies():
    block = vb.lucidrains(axial=True)
    result = rope_export.export_module(block, x())
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert_equal_to_eager(result.model, block, x(batch=3, seed=5))


@pytest.mark.parametrize("axial", [False, True], ids=["1d", "axial"])
def test_plain_export_through_fuse(axial):
    block = vb.lucidrains(axial)
    report = FusionReport()
    fused = fuse(plain_export(block, x(), ({0: torch.export.Dim("batch")},)), report=report, validate=True)
    assert n_rotary(fused) == 2 and (report.found, report.num_fused, report.left) == (2, 2, 0), report.as_text()
    assert_equal_to_eager(fused, block, x(batch=3, seed=6))
