"""Rotations whose cos/sin are graph inputs (the tables a pipeline computes, as CogVideoX's transformer takes
them): fused only where the caller declares the inputs tables (``fuse(table_inputs=...)``; ``export_module``
declares those its census found to be tables), since the graph alone cannot show what will be fed there. The
tables' rows are the latent's F*H*W tokens, a relation torch.export keeps as a symbol of its own
(``Probe.unified`` sizes it)."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

import rope_export
from rope_export.detect import count_rotations
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower

H, D, C = 2, 8, 6


class VideoTokens(torch.nn.Module):
    """q of a [B, F, Hl, Wl, C] latent's F*Hl*Wl tokens, rotated by [tokens, D] tables given as inputs (each
    angle twice in a row, diffusers' interleaved pairs)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(C, H * D)
        generator = torch.Generator().manual_seed(0)
        for parameter in self.proj.parameters():
            torch.nn.init.normal_(parameter, generator=generator)

    def forward(self, latent, cos, sin):
        q = self.proj(latent.flatten(1, 3)).unflatten(-1, (H, D)).transpose(1, 2)  # [B, H, S, D]
        real, imag = q.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imag, real], -1).flatten(3)
        return q * cos + rotated * sin


def _inputs(batch, frames, height, width, seed=0):
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, frames, height, width, C, generator=generator)
    grid = torch.arange(frames * height * width, dtype=torch.float32)[:, None]
    angles = (grid / 10000 ** (torch.arange(0, D, 2) / D)).repeat_interleave(2, -1)
    return latent, angles.cos(), angles.sin()


SHAPES = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("frames"), 2: torch.export.Dim("height"),
           3: torch.export.Dim("width")}, {0: torch.export.Dim("seq")}, {0: torch.export.Dim("seq")})


@pytest.fixture(scope="module")
def plain():
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(VideoTokens(), _inputs(2, 2, 3, 4), dynamo=True, opset_version=18,
                                    input_names=["latent", "cos", "sin"], dynamic_shapes=SHAPES)
    return program.model_proto


def _nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def _assert_matches_eager(model):
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    for size in ((2, 2, 3, 4), (1, 3, 5, 2)):  # the second never traced
        inputs = _inputs(*size, seed=sum(size))
        with torch.no_grad():
            want = VideoTokens()(*inputs)
        got = session.run(None, dict(zip(("latent", "cos", "sin"), (t.numpy() for t in inputs), strict=True)))[0]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_declared_table_inputs_are_fused(plain):
    report = FusionReport()
    fused = fuse(plain, report=report, table_inputs=("cos", "sin"))
    assert len(_nodes(fused)) == 1 and (report.found, report.left) == (1, 0), report.as_text()
    _assert_matches_eager(fused)


def test_undeclared_float_inputs_are_not_taken_for_tables(plain):
    report = FusionReport()
    fused = fuse(plain, report=report)
    (row,) = report.rows()
    assert not _nodes(fused) and "cos² + sin² is not constant" in row.detail, report.as_text()


def test_export_module_declares_the_inputs_its_census_finds_to_be_tables():
    inputs = _inputs(2, 2, 3, 4)
    assert count_rotations(VideoTokens(), inputs).table_inputs == (1, 2)
    result = rope_export.export_module(VideoTokens(), inputs, dynamic_shapes=SHAPES,
                                       input_names=["latent", "cos", "sin"])
    assert result.rotary_nodes == 1 and result.count.ok, result.as_text()
    _assert_matches_eager(result.model)
