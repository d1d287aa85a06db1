"""The report stays readable when positions span 0..131072: power-of-two buckets, one series per runner."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rope_export.check import CheckReport, RunnerReport, write_reports
from rope_export.check.cache_rows import SweepResult
from rope_export.op.tolerances import tolerance


def long_context_report(independent: bool) -> CheckReport:
    rng = np.random.default_rng(0)
    runners = []
    for k, name in enumerate(("onnx-reference", "cpu-twin", "onnxruntime-cpu")):
        r = RunnerReport(name, "pass")
        positions = np.concatenate([np.arange(64), rng.integers(64, 131072, 2000), [131071, -1]])
        r.position_error.add(positions, 1e-7 * (k + 1) * (1 + positions.clip(0) / 131072))
        r.sweep = SweepResult(name, "pass", positions=131072, slices=1)
        r.sweep.position_error.add(np.arange(131072), np.full(131072, 1e-8 * (k + 1)))
        runners.append(r)
    return CheckReport("llama-3.1-8b.onnx", "PyTorch (preset llama-3.1-8b)", "PyTorch", independent, "fp16",
                       tolerance("block", "float16"), runners, inputs="batch 2, seq 16", cases=["prefill"],
                       sweep_tolerance=tolerance("op", "float16"))


@pytest.mark.parametrize("independent", [True, False])
def test_positions_up_to_131072_in_json_markdown_and_png(independent, tmp_path):
    report = long_context_report(independent)
    written = write_reports(report, tmp_path)
    data = json.loads(written[0].read_text())
    buckets = data["runners"][0]["error_by_position"]
    labels = [b["label"] for b in buckets]
    assert labels[:5] == ["< 0", "0", "1", "2-3", "4-7"] and labels[-1] == "65536-131071" and len(labels) == 19
    assert buckets[-1]["max_abs"] == pytest.approx(1e-7 * (1 + 131071 / 131072))
    assert data["runners"][2]["rotary_sweep"]["positions"] == 131072
    sweep = data["runners"][2]["rotary_sweep"]["error_by_position"]
    assert len(sweep) == 18 and sweep[-1]["max_abs"] == pytest.approx(3e-8)
    markdown = written[1].read_text()
    assert "65536-131071" in markdown
    assert ("compared with each other, not with PyTorch" in markdown) != independent
    import matplotlib.image

    image = matplotlib.image.imread(written[2])
    assert image.shape[0] >= 700 and image.shape[1] >= 900  # two panels
    assert image[..., :3].std() > 0.05
