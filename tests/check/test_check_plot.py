"""The error plot draws the rule that decided: errors in units of the limit applied (position allowance
included), and each point's pass/fail by that same rule. Asserted on the plotted data, not on pixels."""

from __future__ import annotations

import numpy as np
import pytest

from rope_export.check.cache_rows import SweepResult
from rope_export.check.compare import limit_ratio, token_limit_ratios
from rope_export.check.report import CheckReport, RunnerReport, error_plot_panels, plot_error_vs_position
from rope_export.op.tolerances import tolerance

OP = tolerance("op", "float32")  # atol 1e-5, rtol 1e-5


def test_limit_ratio_adds_the_allowance_to_atol_and_rtol():
    want = np.array([[0.0, 1.0]])
    got = want + 1.7e-4  # far above atol 1e-5 ...
    assert limit_ratio(got, want, OP).max() > 1
    ratio = limit_ratio(got, want, OP, allowance=np.array([[2e-4]]))  # ... within a position allowance of 2e-4
    assert ratio.max() == pytest.approx(1.7e-4 / (1e-5 + 2e-4))
    assert ratio[0, 1] == pytest.approx(1.7e-4 / (1e-5 + 1e-5 + 2e-4))  # rtol * |expected| counts too
    assert limit_ratio([np.nan], [1.0], OP)[0] == np.inf  # a NaN is an infinite error, never a pass


def test_token_limit_ratios_apply_the_tolerance_at_the_outputs_scale():
    want = np.full((1, 2, 4), 10.0)  # RMS 10: atol becomes 1e-4 (Tolerance.at_scale_of)
    got = want.copy()
    got[0, 1, 0] += 1e-4
    ratios = token_limit_ratios(got, want, OP)
    assert ratios.shape == (1, 2) and ratios[0, 0] == 0
    assert ratios[0, 1] == pytest.approx(1e-4 / (1e-4 + 1e-5 * 10))


def _report_with_sweep(positions, errors, allowance) -> CheckReport:
    sweep = SweepResult("onnxruntime-cpu", status="pass")
    want = np.ones_like(errors)
    sweep.position_error.add(positions, errors, limit_ratio(want + errors, want, OP, allowance))
    runner = RunnerReport("onnxruntime-cpu", "pass", sweep=sweep)
    return CheckReport(model="m.onnx", reference="PyTorch", against="PyTorch", independent=True, dtype="float32",
                       tolerance=tolerance("block", "float32"), runners=[runner], sweep_tolerance=OP)


def test_a_point_above_atol_but_within_the_position_allowance_is_drawn_as_pass_under_the_limit():
    positions = np.array([0, 1000, 3000])
    allowance = 1e-7 * positions  # grows with the position, like the float32-angle allowance of the sweep
    errors = np.array([5e-6, 0.0, 0.0])
    errors[1] = 0.8 * (OP.atol + OP.rtol + allowance[1])  # above atol, inside the allowance at position 1000
    errors[2] = 1.5 * (OP.atol + OP.rtol + allowance[2])  # over even the allowance at position 3000
    report = _report_with_sweep(positions, errors, allowance)
    (panel,) = [p for p in error_plot_panels(report) if "rotary node" in p.title]
    (series,) = panel.series
    assert "allowance" in panel.limit_label and panel.limit == 1.0
    by_bucket = dict(zip(panel.buckets, zip(series.ys, series.passed, strict=True), strict=True))
    y_pass, ok_pass = by_bucket[(1000).bit_length()]
    y_fail, ok_fail = by_bucket[(3000).bit_length()]
    assert errors[1] > OP.atol and ok_pass and y_pass < panel.limit
    assert not ok_fail and y_fail > panel.limit
    assert by_bucket[0] == (pytest.approx(5e-6 / (OP.atol + OP.rtol)), True)
    assert series.passed == [y <= panel.limit for y in series.ys]  # colour and position: one rule


def test_the_plot_is_written_from_those_panels(tmp_path):
    pytest.importorskip("matplotlib")
    report = _report_with_sweep(np.array([0, 7]), np.array([0.0, 2e-5]), 0.0)
    assert plot_error_vs_position(report, tmp_path / "e.png")
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
