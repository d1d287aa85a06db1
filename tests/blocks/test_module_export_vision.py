"""export_module and fuse on vision blocks (2-D RoPE over patches): transformers' DINOv3 ViT and Pixtral,
and planted blocks that a verification on default arguments or random probes would pass wrongly.

Every file that comes out is the ``onnx`` lowering run on onnxruntime against the eager block
(fp32, 1e-5), on the example and with the patch coordinates moved past the traced grid; every
block that cannot be made exact must be refused, with nothing written."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import vision_blocks as vb

import rope_export
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower

pytest.importorskip("transformers")


def n_rotary(model: onnx.ModelProto) -> int:
    return sum(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph.node)


def run_lowered(model: onnx.ModelProto, inputs: tuple) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})


def assert_equal_to_eager(model: onnx.ModelProto, block, inputs: tuple) -> None:
    with torch.no_grad():
        want = [t for t in torch.utils._pytree.tree_leaves(block(*inputs)) if isinstance(t, torch.Tensor)]
    got = run_lowered(model, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)


def plain_export(block, inputs: tuple, dynamic_shapes) -> onnx.ModelProto:
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return torch.onnx.export(block, inputs, dynamo=True, opset_version=18,
                                 dynamic_shapes=dynamic_shapes).model_proto


def coords_dynamic():
    """x [B, N, C] with B and N dynamic, coords [N, 2] sharing N."""
    n = torch.export.Dim("n")
    return ({0: torch.export.Dim("batch"), 1: n}, {0: n})


def test_a_function_called_with_another_switch_than_its_default_is_not_hooked():
    """apply_rot_embed(x, cos, sin, half=False) verifies as interleaved on its defaults; the block calls it
    with half=True (rotate-half). Hooked, the file would differ from the block by O(1): the function is
    checked on the block's own calls, left unhooked, and the traced rotate-half graph is fused exactly."""
    block, inputs = vb.planted("half_switch"), vb.example()
    result = rope_export.export_module(block, inputs, dynamic_shapes=coords_dynamic())
    assert result.hooked == [] and result.rotary_nodes == 2 and result.count.ok, result.as_text()
    (note,) = [n for n in result.notes if n.startswith("not hooked")]
    assert "vision_blocks.apply_rot_embed" in note and "differs from it by" in note
    assert float(note.split("differs from it by ")[1].split(";")[0]) > 1e-2  # the hook's error on this block
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in result.model.graph.node
             if n.op_type == OP_TYPE]
    assert {a["interleaved"] for a in attrs} == {0}
    assert_equal_to_eager(result.model, block, inputs)
    assert_equal_to_eager(result.model, block, vb.example(batch=3, offset=9, seed=4))  # coords past the grid


def test_per_head_tables_shaped_like_per_token_caches_are_folded_exactly(tmp_path):
    """Per-head tables [H, N, D] with batch = heads = 2 have a per-token cache's shape: the hook would
    have rotated batch row b with head b's table. Checked on the block's own call, the function is not
    hooked; the graph's rotation varies per head and is fused with the heads folded into the batch
    (per-row caches), exact at another batch and with coordinates past the grid."""
    out = tmp_path / "per_head.onnx"
    block, inputs = vb.planted("per_head"), vb.example()
    assert inputs[0].shape[0] == vb.HEADS  # the trap: batch = heads
    result = rope_export.export_module(block, inputs, dynamic_shapes=coords_dynamic(), output=out)
    assert result.hooked == [] and result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert any(n.startswith("not hooked: vision_blocks.apply_rope_qk") for n in result.notes)
    assert out.is_file() and n_rotary(onnx.load(out)) == 2
    for case in (inputs, vb.example(batch=3, offset=9, seed=4), vb.example(batch=1, grid=3, seed=5)):
        assert_equal_to_eager(result.model, block, case)


def test_per_head_plain_export_through_fuse():
    block, inputs = vb.planted("per_head"), vb.example()
    report = FusionReport()
    fused = fuse(plain_export(block, inputs, coords_dynamic()), report=report)
    assert n_rotary(fused) == 2 and (report.found, report.left) == (2, 0), report.as_text()
    assert all("heads folded into the batch" in r.detail for r in report.rows())
    for case in (inputs, vb.example(batch=3, offset=9, seed=4)):
        assert_equal_to_eager(fused, block, case)


def test_qwen2_vl_token_major_rotation():
    """Qwen2-VL's vision rotation of [N, H, D] tensors (cos/sin [N, D] unsqueezed to [N, 1, D]): fused as
    [1, N, H*D] with per-token caches through export_module and through fuse of the plain export; exact
    with coordinates past the traced grid and on another grid."""
    n = torch.export.Dim("n")
    dynamic = ({0: n}, {0: n})
    block, inputs = vb.qwen_vision(), vb.token_major_example()
    cases = (inputs, vb.token_major_example(offset=9, seed=4), vb.token_major_example(grid=3, seed=5))
    result = rope_export.export_module(block, inputs, dynamic_shapes=dynamic)
    assert result.rotary_nodes == 2 and result.count.ok and result.count.expected == 2, result.as_text()
    report = FusionReport()
    fused = fuse(plain_export(block, inputs, dynamic), report=report)
    assert n_rotary(fused) == 2 and (report.found, report.left) == (2, 0), report.as_text()
    assert all(r.detail.startswith("thd") for r in report.rows())
    for model in (result.model, fused):
        for case in cases:
            assert_equal_to_eager(model, block, case)


def test_a_wrong_file_is_an_error_naming_the_output_and_its_size(tmp_path, monkeypatch):
    """The end-to-end check on onnxruntime is the backstop: with the real-call check disabled the
    half_switch hook makes a wrong file, and export_module raises before writing it."""
    from rope_export.blocks.check import FileMismatchError
    from rope_export.detect import functions

    def keep_all(module, args, kwargs, found):
        return [functions.RealCallCheck(f, calls=1) for f in found]

    monkeypatch.setattr(functions, "checked_on_real_calls", keep_all)
    out = tmp_path / "wrong.onnx"
    with pytest.raises(FileMismatchError, match=r"differs from the eager block on the example: output '\w+' by "
                                                r"\d\.\d\de[+-]\d\d .*rotary nodes: .*nothing was written"):
        rope_export.export_module(vb.planted("half_switch"), vb.example(), dynamic_shapes=coords_dynamic(),
                                  output=out)
    assert not out.exists()


def test_dinov3_prefix_tokens_and_constant_tables():
    """transformers' DINOv3 ViT: its apply_rotary_pos_emb rotates the 16 patches and leaves the cls and 4
    register tokens alone, and its cos/sin come from the image size (constants in the export). The hook
    cannot take 21 tokens with 16 rows (not hooked, said why); the constant tables are fused as per-token
    caches, one node per rotated tensor."""
    block, pixels = vb.dinov3()
    result = rope_export.export_module(block, (pixels,))
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert any("apply_rotary_pos_emb: its replacement (rotate-half) fails on the block's own call" in n
               for n in result.notes)
    assert_equal_to_eager(result.model, block, (pixels,))
    assert_equal_to_eager(result.model, block, (torch.randn(3, *pixels.shape[1:]),))  # another batch


def test_dinov3_plain_export_through_fuse():
    block, pixels = vb.dinov3()
    model = plain_export(block, (pixels,), ({0: torch.export.Dim("batch")},))
    report = FusionReport()
    fused = fuse(model, report=report, validate=True)
    assert n_rotary(fused) == 2 and report.num_fused == 2, report.as_text()
    assert (report.found, report.left) == (2, 0)  # the graph's own evidence: 2 rotations, none left
    assert "constant table" in " ".join(r.detail for r in report.rows())
    assert_equal_to_eager(fused, block, (torch.randn(3, *pixels.shape[1:]),))


def test_pixtral_axial_rope_with_unsqueeze_dim_0():
    """transformers' Pixtral attention layer: axial H/W frequencies, cos/sin [N, D] unsqueezed at dim 0."""
    block, inputs = vb.pixtral(), vb.example()
    result = rope_export.export_module(block, inputs, dynamic_shapes=coords_dynamic())
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert len(result.hooked) == 1 and "pixtral.apply_rotary_pos_emb" in result.hooked[0]  # checked on its calls
    assert_equal_to_eager(result.model, block, inputs)
    assert_equal_to_eager(result.model, block, vb.example(batch=1, grid=3, offset=5, seed=6))
    fused = fuse(plain_export(block, inputs, coords_dynamic()), validate=True)
    assert n_rotary(fused) == 2
    assert_equal_to_eager(fused, block, vb.example(batch=3, offset=2, seed=7))


def test_a_file_onnxruntime_refuses_is_not_written(tmp_path, monkeypatch):
    """DINOv3's function hooked as it was before the real-call check (21 tokens rotated with caches for 16
    patches): the file's RotaryEmbedding-23 is refused by onnxruntime, an error naming it; nothing written."""
    from rope_export.blocks.check import FileMismatchError
    from rope_export.detect import functions

    monkeypatch.setattr(functions, "checked_on_real_calls",
                        lambda module, args, kwargs, found: [functions.RealCallCheck(f, calls=1) for f in found])
    block, pixels = vb.dinov3()
    out = tmp_path / "dinov3.onnx"
    with pytest.raises(FileMismatchError, match="onnxruntime fails on the fused file .* on the example: .*"
                                                "nothing was written") as info:
        rope_export.export_module(block, (pixels,), output=out)
    assert "rotary nodes: " in str(info.value) and len(str(info.value).splitlines()) == 1
    assert not out.exists()
