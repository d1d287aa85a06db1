"""Real third-party blocks in the layouts fused by a reshape/transpose around one node (issue #25):
Megatron-LM's sequence-first ``[S, B, H, D]`` RoPE (rotate-half, and interleaved over half the head) and
timm's ``RotaryEmbeddingMixed`` (learned per-head 2-D frequencies, Eva's cls token left alone), transcribed
in tests/layout_blocks.py. Each through ``export_module`` and through ``fuse`` of its plain torch.onnx
export: one rotary node per rotated tensor and layer, and the ``onnx`` lowering equal to the eager block on
onnxruntime (fp32, 1e-5 at the output's scale) at another batch and sequence length, and positions past the
traced ones where they are an input. Planted variants: per-batch positions in a sequence-first block (fused
exactly) and timm's mixed table applied with ``half=True`` (not a rotation: refused with the reason)."""

from __future__ import annotations

import functools

import layout_blocks as lb
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import rope_export
from rope_export.detect import DecomposedRotationError
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.tolerances import tolerance
from rope_export.passes import FusionReport, fuse, lower

TOLERANCE = tolerance("op", "float32")  # 1e-5, times the output's RMS where that is above 1


@functools.cache
def exported(name: str):
    return rope_export.export_module(lb.block(name), lb.example(name))


def rotary_attributes(model: onnx.ModelProto) -> list[dict]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node
            if n.domain == DOMAIN and n.op_type == OP_TYPE]


def cases(name: str):
    """Inputs other than the traced ones: batch 3, another length, positions further on."""
    if name.startswith("timm"):
        return [lb.example(name, batch=3, seed=4), lb.example(name, batch=1, seed=5)]
    if name == "megatron_batch_positions":
        return [lb.example(name, seq=7, batch=3, offset=20, seed=4), lb.example(name, seq=2, batch=1, offset=40)]
    return [lb.example(name, seq=7, batch=3, seed=4), lb.example(name, seq=2, batch=1, seed=5)]


def assert_matches_eager(model: onnx.ModelProto, name: str) -> None:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    block = lb.block(name)
    for args in cases(name):
        with torch.no_grad():
            want = block(*args)
        got = session.run(None, dict(zip(names, (a.numpy() for a in args), strict=True)))
        for g, w in zip(got, want, strict=True):
            w = w.numpy()
            assert g.shape == w.shape
            assert TOLERANCE.at_scale_of(w).allclose(g, w), (
                f"{name} at {tuple(args[0].shape)}: max error {np.max(np.abs(g - w)):.3g}")


@pytest.mark.parametrize("name", [*lb.BLOCKS, "megatron_batch_positions"])
def test_export_module_gives_one_node_per_rotated_tensor_and_layer(name):
    _, _, nodes, interleaved = (lb.BLOCKS.get(name) or lb.PLANTED[name])
    result = exported(name)
    attrs = rotary_attributes(result.model)
    assert len(attrs) == nodes and result.rotary_nodes == nodes and result.count.ok, result.as_text()
    assert all(a["interleaved"] == interleaved for a in attrs), attrs
    assert all((a["rotary_embedding_dim"] > 0) == name.endswith("partial") for a in attrs), attrs
    if name in ("megatron_two_layers", "timm_mixed"):  # the census attributes two rotations to each layer
        text = result.as_text()
        prefix = "blocks" if name.startswith("timm") else "layers"
        assert f"{prefix}.0 " in text and f"{prefix}.1 " in text, text
    assert_matches_eager(result.model, name)


def test_megatron_sites_are_fused_sequence_first_and_timm_with_heads_folded_into_the_batch():
    """No function of either library is hooked (Megatron's takes a config, timm's a concatenated table): the
    traced graph is fused, Megatron's [S, B, H, D] with the token axes swapped (sbhd), timm's [H, N, 2D]
    per-head table with every (batch, head) row an op token (rows)."""
    for name, layout in (("megatron", "sbhd"), ("megatron_interleaved_partial", "sbhd"), ("timm_mixed", "rows")):
        rows = exported(name).fusion.rows()
        assert rows and all(r.status == "fused" and r.detail.startswith(layout) for r in rows), [
            r.detail for r in rows]
    # Megatron's table is cos(arange(S) * inv_freq) of the input's length: computed, not a folded constant
    assert all("as the site computes them" in r.detail for r in exported("megatron").fusion.rows())
    assert all("constant table" in r.detail for r in exported("timm_mixed").fusion.rows())  # fixed feat_shape


@pytest.mark.parametrize("name", ["megatron", "megatron_interleaved_partial", "megatron_mscale", "megatron_two_layers",
                                  "megatron_batch_positions", "timm_mixed"])
def test_fuse_of_the_plain_export(name):
    report = FusionReport()
    fused = fuse(lb.plain_export(name), report=report)
    nodes = (lb.BLOCKS.get(name) or lb.PLANTED[name])[2]
    assert len(rotary_attributes(fused)) == nodes and report.num_fused == nodes, report.as_text()
    assert (report.found, report.left, report.complete) == (nodes, 0, True), report.as_text()
    onnx.checker.check_model(fused, full_check=True)
    assert_matches_eager(fused, name)


def test_planted_per_batch_positions_in_a_sequence_first_block_are_not_the_first_rows():
    """Fusing [S, B, H, D] as if the first axis carried the only positions would rotate batch row 1 by row 0's
    positions: the eager block tells the two apart, and the file follows the block (above, batch 3)."""
    block = lb.block("megatron_batch_positions")
    x, pos = lb.example("megatron_batch_positions", seq=4, batch=2, offset=3)
    with torch.no_grad():
        want = block(x, pos)
        naive = block(x, pos[:, :1].expand(-1, 2))
    assert not torch.allclose(want[1][:, 1], naive[1][:, 1], atol=1e-3)
    model = exported("megatron_batch_positions").model
    # the caches are the values the site multiplies by, one row per (s, b) token: no position table
    rows = exported("megatron_batch_positions").fusion.rows()
    assert all("per-token [B, S, rd/2]" in r.detail and "position_ids" not in r.detail for r in rows), [
        r.detail for r in rows]
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, dict(zip([i.name for i in session.get_inputs()], (x.numpy(), pos.numpy()),
                                     strict=True)))
    assert TOLERANCE.allclose(got[1], want[1].numpy())


def test_planted_timm_mixed_table_with_half_true_is_refused_with_the_reason():
    """timm's mixed table is laid out for interleaved pairs; ``apply_rot_embed_cat(..., half=True)`` on it pairs
    channel i with i + D/2 under different angles: no rotation. export_module writes nothing and says why;
    with allow_decomposed the file has no rotary node and computes the block; fuse leaves it alone."""
    with pytest.raises(DecomposedRotationError, match="not RoPE"):
        rope_export.export_module(lb.block("timm_mixed_half"), lb.example("timm_mixed_half"))
    with pytest.warns(UserWarning, match="stayed decomposed"):
        result = rope_export.export_module(lb.block("timm_mixed_half"), lb.example("timm_mixed_half"),
                                           allow_decomposed=True)
    assert result.rotary_nodes == 0 and not rotary_attributes(result.model)
    assert_matches_eager(result.model, "timm_mixed_half")
    report = FusionReport()
    fused = fuse(lb.plain_export("timm_mixed_half"), report=report)
    assert report.num_fused == 0 and not rotary_attributes(fused), report.as_text()
    assert all(r.status == "left alone" for r in report.rows()), report.as_text()
    assert_matches_eager(fused, "timm_mixed_half")
