"""fuse_pairs: ``(a*c - b*s, a*s + b*c)`` joined back (cat, stack, keepdim pairs), in its spellings:
torchtune's stacked cache read by select, Meta's complex product as torch.onnx writes it, the
flipped sign, an export whose reshapes were merged by the optimizer."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import rope_blocks as rb
import torch

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower


def _nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def _tables(model):
    """(cos table, sin table) initializers of the fused nodes."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    (cos,) = {n.input[1] for n in _nodes(model)}
    (sin,) = {n.input[2] for n in _nodes(model)}
    return inits[cos], inits[sin]


def test_torchtune_stacked_cache_becomes_its_cos_and_sin_tables():
    report = FusionReport()
    fused = fuse(rb.plain_export("torchtune"), report=report)
    assert {r.form for r in report.rows()} == {"interleaved pairs"}
    assert all("table + position_ids" in r.detail for r in report.rows()), report.as_text()
    cos, sin = _tables(fused)
    cache = rb.block("torchtune").rope.rope.cache  # torchtune's own [max_seq_len, D/2, 2] buffer
    np.testing.assert_array_equal(cos, cache[..., 0].numpy())
    np.testing.assert_array_equal(sin, cache[..., 1].numpy())
    assert all(n.input[3] == "pos" for n in _nodes(fused))


def test_meta_complex_table_becomes_its_real_and_imaginary_parts():
    fused = fuse(rb.plain_export("meta"))
    cos, sin = _tables(fused)
    freqs_cis = rb.meta_reference().precompute_freqs_cis(rb.D, rb.MAX_POS)  # Meta's own function
    np.testing.assert_allclose(cos, freqs_cis.real.numpy(), atol=1e-7)
    np.testing.assert_allclose(sin, freqs_cis.imag.numpy(), atol=1e-7)


class Flipped(torch.nn.Module):
    """Pairs rotated by -angle: (a*c + b*s, b*c - a*s)."""

    def forward(self, x, pos):
        a = rb.angles(pos)[:, :, None, :]
        c, s = a.cos(), a.sin()
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1).flatten(-2)


def test_flipped_pairs():
    x = torch.randn(rb.B, rb.S, rb.H, rb.D, generator=torch.Generator().manual_seed(0))
    report = FusionReport()
    original = rb.export_plain(Flipped(), (x, rb.example()[1]))
    fused = fuse(original, report=report)
    (row,) = report.rows()
    assert row.status == "fused" and row.form == "interleaved pairs, sin sign flipped", report.as_text()
    feeds = {"x": x.numpy(), "pos": rb.example(offset=3)[1].numpy()}
    want = ort.InferenceSession(original.SerializeToString()).run(None, feeds)[0]
    got = ort.InferenceSession(lower(fused, "onnx").SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_merged_reshapes_flatten_the_pairs_in_the_rewrite():
    """With static shapes torch.onnx's optimizer merges q.view(...) and reshape(..., -1, 2): no value
    holds q as [B, S, H, D]; the fused node gets the pairs flattened."""
    import rope_export

    result = rope_export.export_module(rb.block("torchtune"), rb.example(), opset=18, dynamic_shapes=None)
    graph = ir.from_proto(result.model).graph
    for node in graph:
        if node.domain == DOMAIN:
            assert node.inputs[0].producer().op_type == "Reshape"
    assert result.rotary_nodes == 2


@pytest.mark.parametrize("name", ["pairs_stack", "complex_polar"])
def test_cos_sin_computed_from_positions(name):
    report = FusionReport()
    fused = fuse(rb.plain_export(name), report=report)
    assert len(_nodes(fused)) == 2 and all(len(n.input) == 3 for n in _nodes(fused))  # per-token caches
    assert all("per-token [B, S, rd/2]" in r.detail for r in report.rows())
