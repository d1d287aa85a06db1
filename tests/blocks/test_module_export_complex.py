"""Complex rotations in any spelling through export_module (issue #25): torchtitan's and mistral-inference's
complex ``freqs_cis`` buffers indexed by positions or sliced, a partial complex rotation, and gpt-fast's
real 5-D view (also through ``fuse`` of its plain export). Each gives one rotary node per rotated tensor and
its ``onnx`` lowering equals the eager block in onnxruntime (fp32, 1e-5) at batch 2, for a prefill and for
positions past the traced length. Planted look-alikes (a conjugated table, swapped pair outputs) are fused
exactly or refused with the reason. Blocks: tests/complex_blocks.py."""

from __future__ import annotations

import functools

import complex_blocks as cb
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import rope_blocks as rb
import torch

import rope_export
from rope_export.blocks.export import ModuleExportError
from rope_export.detect import DecomposedRotationError
from rope_export.exporting.complex_pairs import ComplexRewriteError, complex_as_pairs
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower

CASES = ((0, rb.S), (7, 3), (20, 8))  # (position offset, sequence length): prefill, then past the traced length
# in `make test`: one block per library and the partial one; the variants under `make test-slow`
FAST = ("titan_positions", "mistral", "mistral_partial", "gptfast", "llama4_indexed")


def _params(names):
    return [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in names]


@functools.cache
def exported(name: str):
    return rope_export.export_module(cb.block(name), rb.example())


def rotary_attributes(model: onnx.ModelProto) -> list[dict]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node
            if n.domain == DOMAIN and n.op_type == OP_TYPE]


def assert_matches_eager(model: onnx.ModelProto, name: str, batch: int = rb.B) -> None:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    block = cb.block(name)
    names = [i.name for i in session.get_inputs()]
    for offset, seq in CASES:
        x, pos = rb.example(batch=batch, seq=seq, offset=offset, seed=offset + 3)
        with torch.no_grad():
            want = block(x, pos)
        got = session.run(None, dict(zip(names, (x.numpy(), pos.numpy()), strict=True)))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"{name}, offset {offset}")


@pytest.mark.parametrize("name", [*cb.COMPLEX_FORMS, *cb.PLANTED])
def test_pairs_compute_what_the_complex_code_computes(name):
    """complex_as_pairs: the forward with complex tensors held as real pairs equals the complex forward."""
    block = cb.block(name)
    x, pos = rb.example(offset=4)
    with torch.no_grad():
        want = block(x, pos)
        with complex_as_pairs(block):
            got = block(x, pos)
    assert "forward" not in vars(block)  # the module is as it was
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # polar vs cos/sin: last-bit differences


class _MaskedTable(torch.nn.Module):
    """A complex table zeroed (or set to 1) where a mask says, as Lumina 2's caption table past its length."""

    def forward(self, x, keep):
        freqs = torch.polar(torch.ones(x.shape[0], 4), torch.arange(x.shape[0] * 4.0).view(-1, 4) / 3)
        rotated = torch.view_as_complex(x.view(x.shape[0], -1, 2)) * torch.where(keep[:, None], freqs, 0)
        return torch.view_as_real(rotated).flatten(-2), torch.view_as_real(torch.where(keep[:, None], 1.0, freqs))


def test_a_complex_where_is_computed_on_the_pairs():
    block, x, keep = _MaskedTable(), torch.randn(6, 8), torch.tensor([1, 1, 0, 1, 0, 0], dtype=torch.bool)
    want = block(x, keep)
    with complex_as_pairs(block):
        got = block(x, keep)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert (want[0][2] == 0).all() and not (want[0][0] == 0).all()


@pytest.mark.parametrize("name", _params(cb.COMPLEX_FORMS))
def test_complex_spellings_export_one_node_per_rotated_tensor(name):
    result = exported(name)
    attrs = rotary_attributes(result.model)
    assert len(attrs) == 2 and result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert all(a["interleaved"] == 1 for a in attrs)
    partial = cb.COMPLEX_FORMS[name][1]
    assert all((a["rotary_embedding_dim"] > 0) == partial for a in attrs), attrs
    assert_matches_eager(result.model, name)
    assert_matches_eager(result.model, name, batch=3)


def test_a_hooked_complex_function_takes_the_pairs():
    """transformers' Llama 4 apply_rotary_emb is hooked as a function; the table the block indexes reaches its
    replacement as real pairs, and the graph has nothing left to fuse."""
    result = exported("llama4_indexed")
    assert result.hooked and "modeling_llama4.apply_rotary_emb" in result.hooked[0], result.as_text()
    assert result.fusion.num_fused == 0 and result.rotary_nodes == 2
    assert any("traced as real pairs" in n for n in result.notes)


def test_half_precision_complex_rotation():
    """fp16 q/k rotated in float32 complex (``x.float()`` ... ``type_as(x)``): fused with float32 math, and
    export_module's onnxruntime check holds the fp16 file to the eager fp16 block."""
    x, pos = rb.example()
    result = rope_export.export_module(cb.block("titan_positions").half(), (x.half(), pos))
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert all("float32 math" in row.form for row in result.fusion.rows()), result.fusion.as_text()


def test_gpt_fast_real_view_fuses_from_its_plain_export():
    """gpt-fast never makes a complex tensor: torch.onnx exports it, and fuse finds both rotations."""
    model = rb.export_plain(cb.block("gptfast"), rb.example())
    report = FusionReport()
    fused = fuse(model, report=report)
    assert report.found == 2 and report.left == 0 and report.num_fused == 2, report.summary()
    assert len(rotary_attributes(fused)) == 2
    assert_matches_eager(fused, "gptfast")


@pytest.mark.parametrize("name", ["titan_positions", "mistral"])
def test_a_plain_export_under_complex_as_pairs_fuses(name):
    """complex_as_pairs around a user's own torch.onnx.export: the file exports, and fuse finds both rotations."""
    block = cb.block(name)
    with complex_as_pairs(block):
        model = rb.export_plain(block, rb.example())
    report = FusionReport()
    fused = fuse(model, report=report)
    assert report.found == 2 and report.num_fused == 2 and not report.left, report.summary()
    assert_matches_eager(fused, name)


@pytest.mark.parametrize("name", ["conjugated", "conjugated_product"])
def test_a_conjugated_table_is_fused_exactly(name):
    """freqs_cis.conj(): a rotation by -angle; fused with the sign of sin flipped, never as +angle."""
    result = exported(name)
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert [row.form.split()[0] for row in result.fusion.rows()] == ["interleaved"] * 2, result.fusion.as_text()
    assert_matches_eager(result.model, name)  # a rotation by +angle would differ by up to 2|x| here


def test_swapped_pair_outputs_are_refused_with_the_reason(tmp_path):
    out = tmp_path / "swapped.onnx"
    with pytest.raises(DecomposedRotationError) as info:
        rope_export.export_module(cb.block("swapped_pairs"), rb.example(), output=out)
    message = str(info.value)
    assert "2 of 2 rotation(s) stayed decomposed" in message and "not a rotation" in message, message
    assert not out.exists()
    report = FusionReport()
    fuse(rb.export_plain(cb.block("swapped_pairs"), rb.example()), report=report)
    assert report.found == 2 and report.num_fused == 0


def test_a_complex_op_without_rewrite_is_named():
    class Summed(torch.nn.Module):
        def forward(self, x):
            return torch.view_as_real(torch.view_as_complex(x).sum(0, keepdim=True))

    module = Summed()
    with complex_as_pairs(module), pytest.raises(ComplexRewriteError, match="'sum' has no real-pair rewrite"):
        module(torch.randn(3, 4, 2))


def test_export_module_names_the_complex_op_it_cannot_take():
    class Summed(cb.TitanPositions):
        def forward(self, q, k, pos):
            q, k = super().forward(q, k, pos)
            return q * torch.view_as_real(self.freqs_cis.sum(0)).sum(), k

    block = rb.Block(Summed()).eval()
    with pytest.raises(ModuleExportError, match="op 'sum' on a complex tensor has no real-pair rewrite"):
        rope_export.export_module(block, rb.example())
