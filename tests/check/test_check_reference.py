"""check FUSED --reference PLAIN: the user's own plain export against its fused form, matched by I/O names."""

from __future__ import annotations

import onnx
import pytest

pytest.importorskip("transformers")

from check_files import TAMPERING, copy, plain_and_fused, rotary_nodes  # noqa: E402

from rope_export import cli  # noqa: E402
from rope_export.check import CheckError, check  # noqa: E402

RUNNERS = "onnx-reference,cpu-twin,onnxruntime-cpu"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused")
    plain, fused = plain_and_fused()
    assert len(rotary_nodes(fused)) == 2  # q and k of the one layer, fused by rope-export fuse
    onnx.save_model(plain, folder / "plain.onnx")
    onnx.save_model(fused, folder / "fused.onnx")
    return folder


def test_fused_file_matches_the_plain_export_it_came_from(files, capsys):
    assert cli.main(["check", str(files / "fused.onnx"), "--reference", str(files / "plain.onnx"),
                     "--runners", RUNNERS, "--report", str(files / "report")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title wraps where the temp path is long
    assert "against onnxruntime on" in out and "plain.onnx" in out
    report = check(files / "fused.onnx", tuple(RUNNERS.split(",")), reference=files / "plain.onnx")
    assert report.independent and all(r.status == "pass" for r in report.runners)
    compared = {"logits", "present.0.key", "present.0.value"}
    assert all({s.output for stats in r.cases.values() for s in stats} == compared for r in report.runners)


@pytest.mark.parametrize("tampering", TAMPERING)
def test_tampered_fused_file_fails(tampering, files, tmp_path, capsys):
    broken = tmp_path / "fused.onnx"
    onnx.save_model(TAMPERING[tampering](plain_and_fused()[1]), broken)
    code = cli.main(["check", str(broken), "--reference", str(files / "plain.onnx"), "--runners", RUNNERS])
    assert code == 1
    err = capsys.readouterr().err
    for runner in RUNNERS.split(","):
        assert f"runner {runner} disagrees with onnxruntime on" in err and "/logits" in err


def test_reference_whose_inputs_do_not_match_is_refused(files, tmp_path, capsys):
    other = copy(plain_and_fused()[0])
    other.graph.input[1].name = "pos"
    for node in other.graph.node:
        for i, name in enumerate(node.input):
            if name == "position_ids":
                node.input[i] = "pos"
    onnx.save_model(other, tmp_path / "other.onnx")
    assert cli.main(["check", str(files / "fused.onnx"), "--reference", str(tmp_path / "other.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert "do not match the file's" in err and "'pos'" in err and err.count("\n") == 0
    retyped = copy(plain_and_fused()[0])
    retyped.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT32
    with pytest.raises(CheckError, match="input input_ids int32 .* does not match the file's input_ids int64"):
        check(files / "fused.onnx", ("onnxruntime-cpu",), reference=retyped)
    with pytest.raises(CheckError, match="--reference: no such file"):
        check(files / "fused.onnx", reference=tmp_path / "missing.onnx")
