"""fuse_rotation: ``x * cos ± r * sin`` with r any data movement of x. What the rule reads from the
ops (sign of sin, pairs, width) and what it refuses; the zoo (test_passes_fuse_zoo.py) covers the
third-party spellings end to end."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import rope_blocks as rb
import torch

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower


class Written(torch.nn.Module):
    """x [B, S, H, D] (transposed to [B, H, S, D]) rotated by one hand-written expression of rotate-half."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, x, pos):
        x = x.transpose(1, 2)
        a = torch.cat((rb.angles(pos), rb.angles(pos)), dim=-1)[:, None]
        cos, sin = a.cos(), a.sin()
        x1, x2 = x[..., : rb.D // 2], x[..., rb.D // 2 :]
        if self.spelling == "difference":  # x*cos - cat(x2, -x1)*sin: the contract, written as a Sub
            return x * cos - torch.cat((x2, -x1), dim=-1) * sin
        if self.spelling == "unsigned":  # cat(x2, x1): channels swap, no sign change: not a rotation
            return x * cos + torch.cat((x2, x1), dim=-1) * sin
        return x * cos + torch.relu(x) * sin  # the second operand is computed from x, not moved


def _export(spelling):
    x = torch.randn(rb.B, rb.S, rb.H, rb.D, generator=torch.Generator().manual_seed(0))
    return rb.export_plain(Written(spelling), (x, rb.example()[1])), x


def _nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def test_a_difference_of_products_is_the_contract_with_its_own_sign():
    original, x = _export("difference")
    report = FusionReport()
    fused = fuse(original, report=report)
    (row,) = report.rows()
    assert row.status == "fused" and row.form == "rotate-half", report.as_text()
    pos = rb.example()[1].numpy()
    feeds = {"x": x.numpy(), "pos": pos}
    want = ort.InferenceSession(original.SerializeToString()).run(None, feeds)[0]
    got = ort.InferenceSession(lower(fused, "onnx").SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sign_flipped_rotate_half_negates_sin():
    """NanoChat's ``cat(x2, -x1)``: a rotation by -angle; the fused node gets -sin."""
    report = FusionReport()
    fused = fuse(rb.plain_export("nanochat_flipped"), report=report)
    assert {r.form for r in report.rows()} == {"rotate-half, sin sign flipped"}
    producers = {o: n for n in fused.graph.node for o in n.output}
    for node in _nodes(fused):
        assert producers[node.input[2]].op_type == "Neg"


def test_channels_swapped_without_a_sign_change_are_not_a_rotation():
    report = FusionReport()
    fused = fuse(_export("unsigned")[0], report=report)
    (row,) = report.rows()
    assert not _nodes(fused) and row.status == "left alone" and "paired neither" in row.detail


def test_a_computed_second_operand_is_not_a_site():
    report = FusionReport()
    fused = fuse(_export("computed")[0], report=report)
    assert not _nodes(fused) and report.rows() == []


@pytest.mark.parametrize("name", ["glm", "rearrange_unbind"])
def test_cos_sin_spellings_the_structural_trace_does_not_follow(name):
    """GLM slices and re-interleaves cos after an Unsqueeze (rank 4); einops' repeat: the site's own
    cos/sin are reduced per token in the graph, or the structural trace follows them."""
    report = FusionReport()
    fused = fuse(rb.plain_export(name), report=report)
    assert len(_nodes(fused)) == 2 and {r.form.split(" (")[0] for r in report.rows()} == {"interleaved"}
    onnx.checker.check_model(fused, full_check=True)
