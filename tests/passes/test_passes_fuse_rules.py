"""The fusion rules on small hand-made exports: cos/sin sources, operand orders, the pair-by-pair
forms, float32 math under half precision, and the sites that must be left alone (with why)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from passes_util import as_f32, run_ort, run_reference

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.tolerances import tolerance
from rope_export.passes import FusionReport, fuse, lower

B, H, S, D, P = 2, 3, 5, 8, 16


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Rope(torch.nn.Module):
    """x [B, H, S, D] rotated the transformers way, cos/sin from one of several sources."""

    def __init__(self, source: str, swapped: bool = False):
        super().__init__()
        self.source, self.swapped = source, swapped
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = torch.arange(P).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        table = torch.randn(P, D, generator=torch.Generator().manual_seed(0))
        cos_table = table if source == "table-not-duplicated" else emb.cos()
        self.register_buffer("cos_cached", cos_table, persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        if self.source in ("table", "table-not-duplicated"):
            cos, sin = self.cos_cached[position_ids], self.sin_cached[position_ids]
        else:
            freqs = position_ids[..., None].float() * self.inv_freq
            second = freqs * 2 if self.source == "computed-not-duplicated" else freqs
            emb = torch.cat((freqs, second), dim=-1)
            cos, sin = emb.cos() * 1.0, emb.sin() * 1.0
        cos, sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)  # as transformers does
        if self.swapped:
            return cos * x + sin * rotate_half(x)
        return (x * cos) + (rotate_half(x) * sin)


def torchscript(module, dtype=torch.float32) -> onnx.ModelProto:
    x = torch.randn(B, H, S, D).to(dtype)
    pos = torch.arange(S).expand(B, S).contiguous()
    buffer = io.BytesIO()
    axes = {"x": {0: "b", 2: "s"}, "position_ids": {0: "b", 1: "s"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.to(dtype), (x, pos), buffer, dynamo=False, opset_version=17,
                          input_names=["x", "position_ids"], output_names=["y"], dynamic_axes=axes)
    return onnx.load_from_string(buffer.getvalue())


def feeds(dtype=np.float32, seq=S):
    rng = np.random.default_rng(1)
    pos = np.stack([np.arange(seq), np.arange(seq) + 4]).astype(np.int64)
    return {"x": rng.standard_normal((B, H, seq, D)).astype(dtype), "position_ids": pos}


def custom(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


@pytest.mark.parametrize("swapped", [False, True])
def test_table_source_becomes_a_half_width_table_and_position_ids(swapped):
    original = torchscript(Rope("table", swapped))
    report = FusionReport()
    fused = fuse(original, report=report)
    (node,) = custom(fused)
    assert list(node.input)[3] == "position_ids"
    table = next(i for i in fused.graph.initializer if i.name == node.input[1])
    assert list(table.dims) == [P, D // 2]
    (row,) = report.rows()
    assert row.status == "fused" and "[max_pos, rd/2] table + position_ids" in row.detail
    f = feeds()
    assert tolerance("op", "float32").allclose(run_reference(fused, f)[0], run_ort(original, f)[0])


def test_computed_source_keeps_half_width_computation():
    original = torchscript(Rope("computed"))
    fused = fuse(original)
    (node,) = custom(fused)
    assert len(node.input) == 3  # per-token caches, no position_ids
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Cos") == 1 and ops.count("Sin") == 1 and "Concat" not in ops
    f = feeds()
    assert tolerance("op", "float32").allclose(run_ort(lower(fused, "onnx"), f)[0], run_ort(original, f)[0])


@pytest.mark.parametrize("source,reason", [
    ("computed-not-duplicated", "cannot show that cos/sin repeat each frequency twice"),
    ("table-not-duplicated", "the constant cos/sin table is not cat(c, c)"),
])
def test_sites_whose_cos_is_not_duplicated_are_left_alone(source, reason):
    original = torchscript(Rope(source))
    report = FusionReport()
    fused = fuse(original, report=report)
    assert not custom(fused)
    (row,) = report.rows()
    assert row.status == "left alone" and reason in row.detail
    f = feeds()
    np.testing.assert_array_equal(run_ort(fused, f)[0], run_ort(original, f)[0])


def test_uneven_split_is_left_alone_with_the_slices_named():
    class Uneven(Rope):
        def forward(self, x, position_ids):
            cos = self.cos_cached[position_ids].unsqueeze(1)
            sin = self.sin_cached[position_ids].unsqueeze(1)
            rotated = torch.cat((-x[..., 3:], x[..., :5]), dim=-1)  # 5 + 5 channels of 8: not a rotation
            return x * cos + rotated[..., :D] * sin

    report = FusionReport()
    fuse(torchscript(Uneven("table")), report=report)
    assert report.num_fused == 0


def test_old_opsets_are_refused_with_the_conversion_to_do():
    from rope_export.passes import PassError

    original = torchscript(Rope("table"))
    original.opset_import[0].version = 12
    with pytest.raises(PassError, match=r"opset 12; .*convert_version\(model, 13\)"):
        fuse(original)


def test_half_precision_file():
    original = torchscript(Rope("computed"), torch.float16)
    fused = fuse(original)
    assert len(custom(fused)) == 1
    f = feeds(np.float16)
    got, want = run_ort(lower(fused, "onnx"), f)[0], run_ort(original, f)[0]
    assert got.dtype == np.float16 and tolerance("op", "float16").allclose(as_f32(got), as_f32(want))


def test_other_rotary_ops_and_existing_custom_nodes_are_reported_not_touched():
    original = torchscript(Rope("table"))
    fused = fuse(original)
    standard = lower(fused, "onnx", guard_positions=False)
    report = FusionReport()
    again = fuse(standard, report=report)
    assert [r.status for r in report.rows()] == ["other rotary op"]
    assert again.graph.node == standard.graph.node
    report = FusionReport()
    fuse(fused, report=report)
    assert [r.status for r in report.rows()] == ["already fused"]


def test_adopting_the_standard_op_round_trips_a_lowering():
    original = torchscript(Rope("table"))
    fused = fuse(original)
    standard = lower(fused, "onnx", guard_positions=False)
    report = FusionReport()
    adopted = fuse(standard, report=report, adopt_standard=True)
    (row,) = report.rows()
    assert row.status == "fused" and row.form == "ai.onnx RotaryEmbedding-23"
    (node,) = custom(adopted)
    (before,) = custom(fused)
    assert list(node.input) == list(before.input) and node.attribute == before.attribute
    f = feeds()
    assert tolerance("op", "float32").allclose(run_reference(adopted, f)[0], run_ort(original, f)[0])


@pytest.mark.parametrize("preset_name,dtype,form", [
    ("gpt-j-6b", "fp32", "interleaved pairs (partial, 64 of 256)"),  # stack(x1*c - x2*s, ...) form
    ("phi-2", "fp16", "rotate-half (partial, 32 of 80), float32 math"),  # computed in float32 under fp16
])
def test_rope_exports_own_decomposed_files(preset_name, dtype, form):
    """rope_export.presets.export.decomposed_export: the same block with RoPE as plain torch ops."""
    from exported import feeds as block_feeds

    from rope_export.exporting.core import DTYPES
    from rope_export.presets import load_preset
    from rope_export.presets.export import decomposed_export, example_inputs

    preset = load_preset(preset_name).scaled_down()
    original = decomposed_export(preset, dtype=dtype, cache_len=64)
    report = FusionReport()
    fused = fuse(original, report=report)
    assert len(custom(fused)) == 2
    assert {r.form for r in report.rows()} == {form}, report.as_text()
    onnx.checker.check_model(fused, full_check=True)
    f = block_feeds(example_inputs(preset, DTYPES[dtype], False, 2, 5, seed=2))
    name = {"fp32": "float32", "fp16": "float16"}[dtype]
    for got, want in zip(run_ort(lower(fused, "onnx"), f), run_ort(original, f), strict=True):
        assert tolerance("block", name).allclose(as_f32(got), as_f32(want))
