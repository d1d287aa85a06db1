"""``fuse`` (and ``rope-export fuse``) on plain torch.onnx exports of the block zoo: every spelling
of RoPE from third-party code and hand-written forms becomes one node per rotated tensor whose
``onnx`` lowering equals the eager block; look-alikes are left alone with the reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import rope_blocks as rb
import torch

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower


def _nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def _matches_eager(model, name):
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    block = rb.block(name)
    cases = ((0, rb.S),) if name == "xpos" else ((0, rb.S), (7, 3))  # xPos: positions implicit, seq traced static
    for offset, seq in cases:
        x, pos = rb.example(seq=seq, offset=offset, seed=offset + 5)
        with torch.no_grad():
            want = block(x, pos)
        got = session.run(None, {"x": x.numpy(), "pos": pos.numpy()})
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"{name} offset {offset}")


@pytest.mark.parametrize("name", list(rb.FORMS))
def test_fuse_on_the_plain_opset_18_export(name):
    """Opset 18: torch.onnx fuses nothing itself, so every node comes from our rules."""
    report = FusionReport()
    fused = fuse(rb.plain_export(name, 18), report=report)
    assert len(_nodes(fused)) == 2 and report.num_fused == 2, report.as_text()
    assert (report.found, report.left, report.complete) == (2, 0, True)  # the graph's own evidence agrees
    assert all(r.status == "fused" and "verified numerically" in r.detail for r in report.rows())
    onnx.checker.check_model(fused, full_check=True)
    _matches_eager(fused, name)


@pytest.mark.parametrize("name", ["torchtune"] + [pytest.param(n, marks=pytest.mark.slow)
                                                  for n in ("meta", "lucidrains", "glm")])
def test_fuse_on_the_plain_opset_23_export(name):
    """Opset 23: whatever torch.onnx's optimizer already turned into RotaryEmbedding-23 is adopted,
    the rest is ours; 2 nodes either way."""
    report = FusionReport()
    fused = fuse(rb.plain_export(name, 23), report=report, adopt_standard=True)
    assert len(_nodes(fused)) == 2, report.as_text()
    _matches_eager(fused, name)


@pytest.mark.parametrize("target", ["ort", "decomposed"])
@pytest.mark.parametrize("name", ["per_head_angles", "token_major"])
def test_layouts_reshaped_around_the_node_on_the_other_lowerings(name, target):
    """X reshaped to [N, M, D] / [1, T, H*D] around the node: the com.microsoft and decomposed lowerings
    compute the block too (the onnx one is checked above)."""
    fused = fuse(rb.plain_export(name, 18))
    session = ort.InferenceSession(lower(fused, target).SerializeToString(), providers=["CPUExecutionProvider"])
    x, pos = rb.example(seq=3, offset=7, seed=9)
    with torch.no_grad():
        want = rb.block(name)(x, pos)
    for g, w in zip(session.run(None, {"x": x.numpy(), "pos": pos.numpy()}), want, strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"{name} {target}")


@pytest.mark.parametrize("name,reason", [
    ("mismatched_angles", "cos² + sin² is not constant"),
    ("xpos", "xPos-style scaled rotation is not plain RoPE"),
    ("flat_rows", "no head axis"),
])
def test_look_alikes_and_unfusable_rotations_are_left_alone_with_the_reason(name, reason):
    report = FusionReport()
    original = rb.plain_export(name, 18)
    fused = fuse(original, report=report)
    assert not _nodes(fused) and report.num_fused == 0
    rows = report.rows()
    assert len(rows) == 2 and all(r.status == "left alone" and reason in r.detail for r in rows), report.as_text()
    # rotations (and the look-alike's arithmetic) are counted as found and left; xPos's scaled ones are not RoPE
    assert (report.found, report.left) == ((0, 0) if name == "xpos" else (2, 2))
    _matches_eager(fused, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["swiglu", "sinusoidal_added"])
def test_no_rotation_no_row(name):
    report = FusionReport()
    fuse(rb.plain_export(name, 18), report=report)
    assert report.rows() == [] and report.found == 0 and report.complete


def test_cli_on_a_torchtune_export(tmp_path, capsys):
    from rope_export.cli import main

    onnx.save(rb.plain_export("torchtune", 18), tmp_path / "tt.onnx")
    assert main(["fuse", str(tmp_path / "tt.onnx"), "-o", str(tmp_path / "out.onnx")]) == 0
    assert "2 rotation(s) found (cos/sin feeding multiply-add pairs), 2 fused:" in capsys.readouterr().out
    assert len(_nodes(onnx.load(tmp_path / "out.onnx"))) == 2
