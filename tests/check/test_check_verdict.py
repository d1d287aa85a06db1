"""``check`` ends with one verdict line after its tables; the time per step with --verbose or in check.md (issue 40).

The verdict is held to check.json, written by the same run: the runners it counts as agreeing are those whose
status is pass, the skipped ones are named, and a planted defect (a cos row negated, a cos/sin swap) turns it to
FAIL naming what failed.
"""

from __future__ import annotations

import json
import re

import onnx
import pytest
from check_files import change_cache_rows, preset_file, swap_cos_sin

from rope_export import cli

RUNNERS = "onnx-reference,onnxruntime-cpu,tensorrt"  # tensorrt: skipped on machines without it, with its reason
STEP_TABLE = "check: time and peak RSS per step"


def run_check(tmp_path, model, capsys, *extra) -> tuple[int, list[str], dict, str]:
    path, report = tmp_path / "model.onnx", tmp_path / "report"
    onnx.save_model(model, path)
    code = cli.main(["check", str(path), "--runners", RUNNERS, "--report", str(report), *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "internal error" not in captured.err, captured.err[-2000:]
    lines = [line for line in captured.out.splitlines() if line.strip()]
    return code, lines, json.loads((report / "check.json").read_text()), (report / "check.md").read_text()


def verdicts(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("PASS: ", "FAIL: "))]


def test_a_passing_file_ends_with_one_pass_line(tmp_path, capsys):
    code, lines, data, markdown = run_check(tmp_path, preset_file(cache_len=64), capsys)
    assert code == 0 and data["passed"]
    assert verdicts(lines) == [lines[-1]] and lines[-1] == data["verdict"]  # one verdict, the last line
    passing = [r["runner"] for r in data["runners"] if r["status"] == "pass"]
    match = re.fullmatch(r"PASS: (\d+) runners? agrees? with PyTorch, every stored cos/sin row matches the RoPE "
                         r"configuration( \((\d+) skipped: (.*)\))?", lines[-1])
    assert match and int(match.group(1)) == len(passing) == 2, lines[-1]
    skipped = [r for r in data["runners"] if r["status"] == "skipped"]
    assert int(match.group(3) or 0) == len(skipped)
    for r in skipped:  # each skipped runner named with the start of its reason
        assert f"{r['runner']}: {r['reason'].split(' (')[0].split('; ')[0][:40]}" in lines[-1]
    assert STEP_TABLE not in "\n".join(lines)  # the time per step: not without --verbose ...
    assert "## Time and peak RSS per step" in markdown and markdown.rstrip().endswith(lines[-1])  # ... but in check.md


def test_verbose_shows_the_time_per_step_before_the_verdict(tmp_path, capsys):
    code, lines, data, _ = run_check(tmp_path, preset_file(cache_len=64), capsys, "--verbose")
    assert code == 0
    text = "\n".join(lines)
    assert STEP_TABLE in text and text.index(STEP_TABLE) < text.index(lines[-1]) and lines[-1].startswith("PASS: ")


@pytest.mark.parametrize(("defect", "words"), [
    (lambda m: change_cache_rows(m, slice(40, 44)), ["1 stored cos/sin table off the RoPE configuration"]),
    (swap_cos_sin, ["onnx-reference disagrees with PyTorch", "onnxruntime-cpu disagrees with PyTorch",
                    "0 of 2 runners agree"]),
], ids=["cos-rows-negated", "cos-sin-swapped"])
def test_a_failing_file_ends_with_one_fail_line_naming_what_failed(tmp_path, capsys, defect, words):
    code, lines, data, _ = run_check(tmp_path, defect(preset_file(cache_len=64)), capsys)
    assert code == 1 and not data["passed"]
    assert verdicts(lines) == [lines[-1]] and lines[-1].startswith("FAIL: ") and lines[-1] == data["verdict"]
    for word in words:
        assert word in lines[-1], lines[-1]
