"""check proves every cache row: stored tables row by row, and each rotary node alone over every position."""

from __future__ import annotations

import onnx
import pytest
from check_files import change_cache_rows, one_node_file, preset_file

from rope_export import cli
from rope_export.check import check
from rope_export.passes import lower

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


def test_a_correct_file_has_every_row_proved_on_every_runner():
    report = check(preset_file(), RUNNERS)
    assert report.passed, report.failure_message()
    assert {(t.role, t.rows, t.against) for t in report.tables} == {
        ("cos", 512, "the RoPE configuration"), ("sin", 512, "the RoPE configuration")}
    for r in report.runners[:3]:
        assert r.sweep.status == "pass" and r.sweep.positions == 512 and r.sweep.out_of_range > 0
        assert r.sweep.max_abs < 1e-5


def test_negated_rows_300_to_479_fail(tmp_path, capsys):
    path = tmp_path / "negated.onnx"
    onnx.save_model(change_cache_rows(preset_file(), slice(300, 480)), path)
    assert cli.main(["check", str(path), "--runners", ",".join(RUNNERS)]) == 1
    err = capsys.readouterr().err
    assert "cos cache 'rotary.cos_cache' rows 300-479 differ from the RoPE configuration" in err
    for runner in RUNNERS:  # every runner reads the broken rows when the node runs alone
        assert f"runner {runner}, rotary node alone: " in err
    assert err.count("positions 300-479 differ") == len(RUNNERS)


@pytest.mark.parametrize(("role", "row"), [("cos", 0), ("sin", 1), ("cos", 257), ("sin", 511)])
def test_any_single_row_changed_fails(role, row):
    report = check(change_cache_rows(preset_file(), row, role, how=lambda v: v + 1e-3), ("cpu-twin",))
    assert not report.passed
    (bad,) = [t for t in report.tables if not t.passed]
    assert bad.role == role and bad.bad_rows == [(row, row)]
    assert report.runners[0].sweep.status == "FAIL" and f"positions {row} differ" in report.runners[0].sweep.reason


def test_a_file_lowered_to_plain_ops_still_has_its_rows_proved():
    lowered = lower(change_cache_rows(preset_file(), 100), "decomposed")
    report = check(lowered, ("onnxruntime-cpu",))
    assert not report.passed
    assert [(t.role, t.bad_rows) for t in report.tables if not t.passed] == [("cos", [(100, 100)])]
    assert report.runners[0].sweep is None or report.runners[0].sweep.status == "skipped"


def test_one_node_without_metadata_runners_compared_with_each_other(tmp_path, capsys):
    path = tmp_path / "one-node.onnx"
    onnx.save_model(one_node_file(), path)
    assert cli.main(["check", str(path), "--runners", "cpu-twin,onnx-reference", "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "runners compared with onnx-reference, not with PyTorch" in " ".join(out.split())
    report = check(path, ("cpu-twin", "onnx-reference"))
    assert not report.independent and [r.status for r in report.runners] == ["pass", "golden"]
    assert report.runners[0].sweep.positions == 512  # the stored rows, each through the twin
    assert {t.against for t in report.tables} == {"a fitted rotation table"} and all(t.passed for t in report.tables)
    markdown = (tmp_path / "check.md").read_text()
    assert "the runners compared with each other, not with PyTorch" in markdown


@pytest.mark.parametrize("change", ["negate-300-479", "one-row"])
def test_one_node_without_metadata_fails_on_changed_rows(change):
    rows, how = (slice(300, 480), lambda v: -v) if change == "negate-300-479" else (77, lambda v: v * 1.001)
    report = check(change_cache_rows(one_node_file(), rows, "sin", how), ("cpu-twin", "onnx-reference"))
    assert not report.passed
    (bad,) = [t for t in report.tables if not t.passed]
    assert bad.role == "cos/sin" and bad.bad_rows == ([(300, 479)] if change == "negate-300-479" else [(77, 77)])


def test_a_row_of_gptjs_sin_cos_table_changed_fails_when_the_node_runs_alone():
    """GPT-J keeps sin|cos per position in one table the graph gathers: no [rows, rd/2] cache, so the
    sweep (the node with its gather, over every position) is what sees the row."""
    pytest.importorskip("transformers")
    from check_files import copy, hf_file
    from onnx import numpy_helper

    model = copy(hf_file("gptj"))
    # embed_positions, folded ([1, 32, 4] or, with transformers 5.24's indexing, [32, 4])
    init = next(i for i in model.graph.initializer if list(i.dims) in ([1, 32, 4], [32, 4]))
    table = numpy_helper.to_array(init).copy()
    table.reshape(32, 4)[20] *= -1
    init.CopyFrom(numpy_helper.from_array(table, init.name))
    report = check(model, ("cpu-twin", "onnxruntime-cpu"))
    assert not report.passed and not report.tables
    for r in report.runners:
        assert r.sweep.status == "FAIL" and "positions 20 differ from the RoPE configuration" in r.sweep.reason
