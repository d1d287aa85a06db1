"""Plumbing of the passes: accepted model kinds, loading and atomic saving, the value helpers."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from passes_util import rotary_case

from rope_export import cli
from rope_export.passes import FusionReport, PassError, fuse, load_ir, load_model, lower, save_model
from rope_export.passes._model import onnx_opset
from rope_export.passes._values import static_ints


def test_paths_are_accepted_and_loaded_lazily(tmp_path):
    model, feeds, expected = rotary_case(max_pos=64)  # caches of 2 kB: external
    path = tmp_path / "m.onnx"
    save_model(model, path, external="single")
    lowered = lower(path, "decomposed")
    assert isinstance(lowered, ir.Model)  # a path comes back as an ir.Model: its weights stay on disk
    caches = [v.const_value for v in lowered.graph.initializers.values() if v.name in ("cos", "sin")]
    assert [type(c).__name__ for c in caches] == ["ExternalTensor", "ExternalTensor"]
    save_model(lowered, tmp_path / "out.onnx")
    got = ReferenceEvaluator(onnx.load(str(tmp_path / "out.onnx"))).run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_wrong_kinds_and_files_are_named(tmp_path):
    with pytest.raises(TypeError, match="expected an onnx.ModelProto, an onnx_ir.Model or a path"):
        lower(42, "onnx")
    with pytest.raises(FileNotFoundError, match="no such ONNX file"):
        load_model("/nonexistent/model.onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(PassError, match="empty.onnx is empty"):
        load_ir(tmp_path / "empty.onnx")


def test_save_is_atomic_and_leaves_nothing_behind(tmp_path, monkeypatch):
    model, _, _ = rotary_case()
    path = tmp_path / "m.onnx"
    save_model(model, path)
    assert onnx.load(path) == model
    original = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(onnx, "save_model", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, path)
    monkeypatch.undo()
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        save_model(model, tmp_path / "no" / "m.onnx")


# -- large files: the passes never read the weights ----------------------------------------------

_opened: list[str] | None = None


def _audit(event, args):
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def files_opened():
    """The paths opened by Python code inside the block (the interpreter's "open" audit events)."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def _forced_external(model: onnx.ModelProto, path) -> None:
    save_model(model, path, external="single")  # as a > 2 GB file is written, at a small size
    stored = onnx.load(str(path), load_external_data=False).graph.initializer
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in stored) >= 2


@pytest.mark.parametrize("target", ["trt-plugin", "onnx", "ort", "decomposed"])
def test_lowering_a_loaded_file_never_opens_its_weights(tmp_path, target):
    from exported import (
        CACHE_LEN,  # noqa: F401 - the shared test export settings
        exported_model,
    )

    source = tmp_path / "model.onnx"
    _forced_external(exported_model("tiny", "fp32", decode=False), source)
    data = str(tmp_path / "model.onnx.data")
    model = load_ir(source)
    with files_opened() as opened:
        lowered = lower(model, target)
    assert data not in opened, f"lower({target}) read the weights"
    with files_opened() as opened:
        save_model(lowered, tmp_path / "out.onnx", external="single")
    assert data in opened  # the write streams them (and the audit hook does see such opens)
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(source)).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "out.onnx")).graph.initializer}
    for name in set(before) & set(after):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_fusing_a_loaded_file_never_opens_its_weights(tmp_path):
    from hf_models import exported_causal_lm

    source = tmp_path / "plain.onnx"
    _forced_external(exported_causal_lm("llama"), source)
    model = load_ir(source)
    report = FusionReport()
    with files_opened() as opened:
        fused = fuse(model, report=report)
    assert report.num_fused == 2
    assert str(tmp_path / "plain.onnx.data") not in opened, "fuse read the weights"
    save_model(fused, tmp_path / "fused.onnx", external="per-tensor")
    onnx.checker.check_model(str(tmp_path / "fused.onnx"), full_check=True)


@pytest.mark.parametrize("command", ["lower", "fuse"])
@pytest.mark.parametrize("content", [b"", b"\x08\x07garbage that is not a model"])
def test_cli_refuses_a_broken_file_in_one_line_and_writes_nothing(tmp_path, capsys, command, content):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    argv = [command, str(bad), "-o", str(tmp_path / "out.onnx")] + (["-t", "onnx"] if command == "lower" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "bad.onnx" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


def test_cli_checks_the_output_folder_before_loading(tmp_path, capsys, monkeypatch):
    import rope_export.passes as passes

    def never(path):
        raise AssertionError("the input was loaded before the output folder was checked")

    monkeypatch.setattr(passes, "load_ir", never)
    assert cli.main(["lower", str(tmp_path / "in.onnx"), "-t", "onnx", "-o", str(tmp_path / "no" / "x.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_two_ai_onnx_imports_are_rejected():
    model, _, _ = rotary_case()
    model.opset_import.append(helper.make_opsetid("ai.onnx", 18))
    with pytest.raises(PassError, match="imports two ai.onnx opsets"):
        onnx_opset(ir.from_proto(model))


def test_static_ints_resolves_torchscript_shape_arithmetic():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "h", "s", 16])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Constant", [], ["three"], value=helper.make_tensor("t", onnx.TensorProto.INT64, [], [3])),
        helper.make_node("Gather", ["shape", "three"], ["d"], axis=0),
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", onnx.TensorProto.INT64, [], [2])),
        helper.make_node("Div", ["d", "two"], ["half"]),
        helper.make_node("Cast", ["half"], ["half64"], to=onnx.TensorProto.INT64),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("t", onnx.TensorProto.INT64, [1], [0])),
        helper.make_node("Unsqueeze", ["half64", "zero"], ["end"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
    ]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("end", onnx.TensorProto.INT64, None),
                                                  helper.make_tensor_value_info("batch", onnx.TensorProto.INT64, None)])
    model = ir.from_proto(helper.make_model(graph))
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert static_ints(values["end"]) == [8]
    assert static_ints(values["batch"]) is None  # symbolic
    known = {model.graph.inputs[0]: [None, None, None, 10]}
    assert static_ints(values["end"], known) == [5]
    assert static_ints(values["shape"]) is None  # b, h, s are symbolic
