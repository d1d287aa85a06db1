"""The TensorRT engine path (rope_export.trt). Without TensorRT and a GPU only the one-line refusal
and the argument parsing are tested; the engine tests skip, saying why."""

from __future__ import annotations

import sys

import pytest
import torch

from rope_export import cli, reference
from rope_export import trt as rtrt
from rope_export.cli import CLIError
from rope_export.tolerances import tolerance

UNAVAILABLE = rtrt.tensorrt_unavailable_reason()


def _cli(monkeypatch, argv):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rope_export.plugin_build", "rope_export.trt"])
    return cli.main(argv)


def test_build_without_tensorrt_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, on any machine
    rc = _cli(monkeypatch, ["build", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.engine")])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1
    assert err.startswith("rope-export build: error: TensorRT is not installed")
    assert not (tmp_path / "m.engine").exists()


def test_parse_shape():
    assert rtrt.parse_shape("x:1x8x16x64") == ("x", ((1, 8, 16, 64),) * 3)
    assert rtrt.parse_shape("input:0:1x4:2x4:8x4") == ("input:0", ((1, 4), (2, 4), (8, 4)))
    for bad in ["x", ":1x2", "x:1xa", "x:1x2:1x2x3:1x2", "x:1x2:3x4:"]:
        with pytest.raises(CLIError, match="--shape"):
            rtrt.parse_shape(bad)


def test_missing_plugin_library_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="rope-export build-plugin"):
        rtrt.load_plugins([tmp_path / "librope_export_trt_plugin.so"])


def _rotary_onnx(path, dtype, interleaved, with_pos):
    """One trt-plugin node, as the lowering writes it (string routing attributes included)."""
    import onnx
    from onnx import TensorProto, helper

    elem = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}[dtype]
    inputs = [
        helper.make_tensor_value_info("x", elem, ["b", 8, "s", 64]),
        helper.make_tensor_value_info("cos", elem, [128, 32] if with_pos else ["b", "s", 32]),
        helper.make_tensor_value_info("sin", elem, [128, 32] if with_pos else ["b", "s", 32]),
    ]
    if with_pos:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]))
    node = helper.make_node(
        "RotaryEmbedding",
        [i.name for i in inputs],
        ["y"],
        domain="trt.plugins",  # as rope_export.passes.lower_trt_plugin writes it
        interleaved=int(interleaved),
        num_heads=0,
        rotary_embedding_dim=64,
        plugin_namespace="rope_export",
        plugin_version="1",
    )
    graph = helper.make_graph([node], "rotary", inputs, [helper.make_tensor_value_info("y", elem, ["b", 8, "s", 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt.plugins", 1)])
    onnx.save(model, path)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved, with_pos", [(False, True), (True, False)])
def test_engine_builds_saves_loads_and_matches_reference(tmp_path, dtype, interleaved, with_pos):
    plugin_lib = rtrt.default_plugin_library()
    if not plugin_lib.is_file():
        pytest.skip(f"{plugin_lib} not built (rope-export build-plugin with TensorRT headers and libraries)")
    onnx_path, engine_path = tmp_path / "rotary.onnx", tmp_path / "rotary.engine"
    _rotary_onnx(onnx_path, dtype, interleaved, with_pos)
    shapes = {"x": ((1, 8, 1, 64), (2, 8, 16, 64), (4, 8, 64, 64))}
    if with_pos:
        shapes["position_ids"] = ((1, 1), (2, 16), (4, 64))
    else:
        shapes["cos"] = shapes["sin"] = ((1, 1, 32), (2, 16, 32), (4, 64, 32))
    rtrt.build_engine(onnx_path, engine_path, [plugin_lib], shapes)
    engine = rtrt.load_engine(engine_path, [plugin_lib])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 10, 64, generator=gen).to(dtype)
    rows = (128,) if with_pos else (3, 10)
    cos, sin = (torch.randn(*rows, 32, generator=gen).to(dtype) for _ in range(2))
    feeds = {"x": x, "cos": cos, "sin": sin}
    pos = None
    if with_pos:
        pos = torch.randint(-2, 130, (3, 10), generator=gen)
        feeds["position_ids"] = pos
    y = torch.as_tensor(rtrt.run_engine(engine, feeds)["y"]).cpu()
    expected = reference.rotary_embedding(x, cos, sin, pos, interleaved=interleaved, rotary_embedding_dim=64)
    assert tolerance("op", str(dtype)).allclose(y.float(), expected.float())
