"""export_module on every block of the zoo (third-party RoPE code and every spelling the fusion must
find): one rotary node per rotated tensor, the ``onnx`` lowering equal to the eager module in
onnxruntime (fp32, 1e-5) for a prefill and with positions offset; look-alikes left alone with the
reason; a rotation the op cannot take stops the export unless allowed. ``rope-export fuse`` on the
plain exports is tested in tests/passes/test_passes_fuse_zoo.py."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import rope_blocks as rb
import torch

import rope_export
from rope_export.detect import DecomposedRotationError
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import lower

CASES = ((0, rb.S), (7, 3))  # (position offset, sequence length): prefill, and positions further on
THIRD_PARTY = ("torchtune", "meta", "lucidrains")  # in `make test`; the other spellings under `make test-slow`
# fused by a reshape of X around the node (heads folded into the batch, [T, H, D] as [1, T, H*D])
LAYOUTS = ("per_head_angles", "token_major", "per_head_interleaved_partial", "per_head_stack", "per_head_pairs")


def _params(names, fast):
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in names]


@functools.cache
def exported(name: str):
    return rope_export.export_module(rb.block(name), rb.example())


def rotary_attributes(model: onnx.ModelProto) -> list[dict]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node
            if n.domain == DOMAIN and n.op_type == OP_TYPE]


def assert_matches_eager(model: onnx.ModelProto, name: str) -> None:
    """The ``onnx`` lowering in onnxruntime equals the eager block, fp32 1e-5, both cases."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    block = rb.block(name)
    names = [i.name for i in session.get_inputs()]
    for offset, seq in CASES[:1] if name == "xpos" else CASES:  # xPos: positions implicit, seq traced static
        x, pos = rb.example(seq=seq, offset=offset, seed=offset + 3)
        with torch.no_grad():
            want = block(x, pos)
        got = session.run(None, dict(zip(names, (x.numpy(), pos.numpy()), strict=True)))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"{name}, offset {offset}")


@pytest.mark.parametrize("name", _params(rb.FORMS, THIRD_PARTY + LAYOUTS))
def test_every_form_exports_one_node_per_rotated_tensor(name):
    form = rb.FORMS[name]
    result = exported(name)
    attrs = rotary_attributes(result.model)
    assert len(attrs) == 2 and result.rotary_nodes == 2, result.as_text()
    assert result.count.ok and result.count.expected == 2
    assert {a["interleaved"] for a in attrs} == {int(form.interleaved)}
    assert all((a["rotary_embedding_dim"] > 0) == form.partial for a in attrs)
    assert_matches_eager(result.model, name)


def test_known_functions_are_hooked_the_rest_fused():
    """Meta's apply_rotary_emb is found in the block's code and routed through the op while tracing;
    torchtune's rotation is a method (no function to hook): the traced graph is fused."""
    meta, torchtune = exported("meta"), exported("torchtune")
    assert len(meta.hooked) == 1 and "apply_rotary_emb" in meta.hooked[0] and "(complex)" in meta.hooked[0]
    assert meta.fusion.num_fused == 0 and meta.rotary_nodes == 2
    assert torchtune.hooked == [] and torchtune.fusion.num_fused == 2


@pytest.mark.parametrize("name", _params(rb.LOOK_ALIKES, ("xpos", "mismatched_angles")))
def test_look_alikes_are_left_alone_and_the_report_says_why(name):
    result = exported(name)
    assert result.rotary_nodes == 0 and result.count.ok, result.as_text()
    assert_matches_eager(result.model, name)
    text = result.as_text()
    if name == "xpos":
        assert "2 xPos-style scaled (not RoPE)" in text and "extra factor" in text
    if name == "mismatched_angles":
        assert "cos² + sin² is not constant" in text


def test_a_rotation_the_op_cannot_take_stops_the_export(tmp_path):
    out = tmp_path / "block.onnx"
    with pytest.raises(DecomposedRotationError) as info:
        rope_export.export_module(rb.block("flat_rows"), rb.example(), output=out)
    message = str(info.value)
    assert "2 of 2 rotation(s) stayed decomposed" in message and "rows with no head axis" in message
    assert "rope: 2 rotation(s), 0 fused" in message and not out.exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = rope_export.export_module(rb.block("flat_rows"), rb.example(), output=out,
                                           allow_decomposed=True)
    assert out.is_file() and result.rotary_nodes == 0 and not result.count.ok
    assert any("stayed decomposed" in str(w.message) for w in caught)
    assert_matches_eager(onnx.load(out), "flat_rows")


def test_opset_18_and_static_shapes():
    result = rope_export.export_module(rb.block("torchtune"), rb.example(), opset=18, dynamic_shapes=None)
    assert result.rotary_nodes == 2
    dims = [d.dim_value for d in result.model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [rb.B, rb.S, rb.HIDDEN]


def test_wrong_inputs_are_named():
    from rope_export.exporting.core import ExportError

    with pytest.raises(ExportError, match="opset 12"):
        rope_export.export_module(rb.block("torchtune"), rb.example(), opset=12)
    with pytest.raises(ValueError, match="expected a torch.nn.Module"):
        rope_export.export_module(lambda x: x, rb.example())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rope_export.export_module(rb.block("torchtune"), rb.example(), output="/nonexistent/dir/x.onnx")


def test_cli_module_spec(tmp_path, capsys):
    from rope_export.cli import main

    out = tmp_path / "tt.onnx"
    spec = f"{rb.__file__}:torchtune_factory"
    assert main(["export", "--module", spec, "-o", str(out)]) == 0
    assert len(rotary_attributes(onnx.load(out))) == 2
    assert "2 rotary node(s) for 2 rotation(s)" in capsys.readouterr().out
    assert main(["export", "--module", f"{rb.__file__}:unfusable_factory", "-o", str(out)]) == 2
    assert "stayed decomposed" in capsys.readouterr().err
    assert main(["export", "--module", f"{rb.__file__}:unfusable_factory", "-o", str(out),
                 "--allow-decomposed"]) == 0
    for bad, reason in (("no_colon", "expected PACKAGE.MODULE:FACTORY"), ("rope_blocks_missing:f", "importing"),
                        (f"{rb.__file__}:nothing_here", "has no callable 'nothing_here'"),
                        (f"{rb.__file__}:rotate_half", "rotate_half() failed")):
        assert main(["export", "--module", bad, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert reason in err and len(err.strip().splitlines()) == 1, err


def test_the_file_records_the_eager_outputs_of_the_example():
    import base64
    import io

    block = rb.block("rotate_half_table")
    x, pos = rb.example()
    result = rope_export.export_module(block, (x, pos), input_names=["x", "pos"])
    meta = {p.key: p.value for p in result.model.metadata_props}
    assert meta["rope_export.source"] == "module" and meta["rope_export.module"].endswith(".Block")
    with np.load(io.BytesIO(base64.b64decode(meta["rope_export.module_example"]))) as data:
        assert np.array_equal(data["input/x"], x.numpy()) and np.array_equal(data["input/pos"], pos.numpy())
        with torch.no_grad():
            out, k = block(x, pos)
        assert np.array_equal(data[f"output/{result.model.graph.output[0].name}"], out.numpy())
        assert np.array_equal(data[f"output/{result.model.graph.output[1].name}"], k.numpy())


def test_an_example_past_the_limit_is_not_recorded_and_said_so(monkeypatch):
    from rope_export.blocks import export as module_export

    monkeypatch.setattr(module_export, "EXAMPLE_LIMIT", 1000)
    result = rope_export.export_module(rb.block("rotate_half_table"), rb.example())
    assert "rope_export.module_example" not in {p.key for p in result.model.metadata_props}
    assert any(n.startswith("example not recorded: its inputs and outputs take") for n in result.notes)
