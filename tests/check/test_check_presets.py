"""check on preset exports: passes on every correct lowering, fails by name on broken files, writes reports."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from check_files import TAMPERING
from exported import exported_model
from onnx import numpy_helper

from rope_export import cli
from rope_export.check import CheckError, check, position_buckets, write_reports
from rope_export.op.contract import DOMAIN
from rope_export.passes import lower

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


def custom_model(dtype="fp32"):
    model = onnx.ModelProto()
    model.CopyFrom(exported_model("tiny", dtype))
    return model


def rotary_nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN]


@pytest.mark.parametrize("target", [None, "trt-plugin", "onnx", "ort", "decomposed"])
def test_every_correct_lowering_passes(target):
    model = custom_model() if target is None else lower(custom_model(), target)
    report = check(model, RUNNERS)
    ran = [r for r in report.runners if r.status != "skipped"]
    assert ran, "no runner ran"
    assert report.passed, report.failure_message()
    for r in ran:
        assert set(r.cases) >= {"prefill", "long-sequence", "large-magnitude", "decode-end-of-positions",
                                "past-end-of-positions"}
        assert r.max_abs is not None and r.max_abs < 1e-3


def test_half_precision_file_passes_with_half_tolerances():
    report = check(custom_model("fp16"), ("onnx-reference", "cpu-twin"))
    assert report.passed, report.failure_message()
    assert report.tolerance.rtol > 1e-3  # the fp16 block tolerance, not fp32's


def wrong_cache(model):
    name = rotary_nodes(model)[0].input[1]
    init = next(i for i in model.graph.initializer if i.name == name)
    cos = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(np.roll(cos, 1, axis=0), name))  # row p holds position p-1
    return model


BREAKAGES = {**TAMPERING, "cache-rolled-by-one-row": wrong_cache}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_broken_file_fails_naming_runner_and_output(breakage, tmp_path, capsys):
    path = tmp_path / "broken.onnx"
    onnx.save_model(BREAKAGES[breakage](custom_model()), path)
    assert cli.main(["check", str(path), "--runners", ",".join(RUNNERS)]) == 1
    err = capsys.readouterr().err
    for runner in RUNNERS:  # every runner runs the broken graph, so every one must disagree
        assert f"runner {runner} disagrees with PyTorch on" in err
    assert "/output" in err or "/present_key" in err


def test_reports_are_written_and_readable(tmp_path):
    report = check(custom_model(), RUNNERS)
    written = write_reports(report, tmp_path / "report")
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == sorted(p.name for p in written)
    assert [p.name for p in written] == ["check.json", "check.md", "error_vs_position.png"]
    data = json.loads(written[0].read_text())
    assert data["passed"] is True and [r["runner"] for r in data["runners"]] == list(RUNNERS)
    buckets = data["runners"][0]["error_by_position"]
    assert buckets[0]["from"] == 0 and buckets[-1]["to"] >= 64 - 1  # end of the 64-row cache was exercised
    assert "| onnx-reference | pass |" in written[1].read_text()
    import matplotlib.image

    image = matplotlib.image.imread(written[2])
    assert image.shape[0] > 300 and image.shape[1] > 600  # a real plot, not an empty file
    assert image[..., :3].std() > 0.05


def test_position_buckets_are_powers_of_two_and_take_the_max():
    points = [(0, 1.0), (1, 3.0), (2, 2.0), (3, 5.0), (70000, 0.25), (131071, 0.5), (-1, 7.0)]
    assert [(b["label"], b["tokens"], b["max_abs"]) for b in position_buckets(points)] == [
        ("< 0", 1, 7.0), ("0", 1, 1.0), ("1", 1, 3.0), ("2-3", 2, 5.0), ("65536-131071", 2, 0.5)]


def test_check_rejects_what_it_cannot_check(tmp_path):
    with pytest.raises(CheckError, match="unknown runner 'gpu'"):
        check(custom_model(), ("gpu",))
    with pytest.raises(CheckError, match="no such file"):
        check(tmp_path / "missing.onnx")


def test_without_metadata_the_runners_are_compared_with_onnx_reference():
    bare = custom_model()
    del bare.metadata_props[:]
    report = check(bare, ("onnx-reference", "cpu-twin", "onnxruntime-cpu"))
    assert report.passed and not report.independent and report.against == "onnx-reference"
    assert [r.status for r in report.runners] == ["golden", "pass", "pass"]


def test_cli_check_passes_and_writes_report(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save_model(custom_model(), path)
    assert cli.main(["check", str(path), "--runners", "onnx-reference,cpu-twin", "--report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "cpu-twin" in out and "pass" in out and "check.json" in out


def test_bfloat16_file_runs_where_it_can_and_says_why_not_elsewhere():
    report = check(custom_model("bf16"), ("onnx-reference", "cpu-twin", "onnxruntime-cpu"))
    assert report.passed, report.failure_message()
    status = {r.runner: r for r in report.runners}
    assert status["cpu-twin"].status == "pass" and status["cpu-twin"].sweep.status == "pass"
    skipped = status["onnxruntime-cpu"]
    assert skipped.status == "skipped" and "no bfloat16 NumPy input" in skipped.reason
