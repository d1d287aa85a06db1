"""Tables in 80 columns and in logs: every name whole, no ellipsis, no line past the width."""

from __future__ import annotations

import io
import subprocess
import sys

from rich.console import Console

from rope_export.check.report import CheckReport, RunnerReport, print_report
from rope_export.common.tables import LOG_WIDTH, print_table, table
from rope_export.op.tolerances import tolerance
from rope_export.presets import preset_names


def _terminal(width: int) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=True, color_system=None), buf


def test_a_table_too_wide_for_80_columns_wraps_at_spaces_and_keeps_names_whole():
    console, buf = _terminal(80)
    names = ["phi-3.5-mini-128k", "qwen2.5-7b-yarn", "onnxruntime-cuda"]
    t = table("t", ("name", "a long heading", "another long heading", "layout", "rope type", "max position"),
              keep=("name",))
    for name in names:
        t.add_row(name, "some words here", "more words", "rotate-half", "longrope", "131072")
    print_table(console, t)
    out = buf.getvalue()
    assert "…" not in out
    assert all(len(line) <= 80 for line in out.splitlines())
    for word in (*names, "rotate-half", "longrope", "131072"):
        assert word in out, word


def test_presets_in_a_log_with_columns_80_prints_every_name_whole():
    proc = subprocess.run([sys.executable, "-m", "rope_export.cli", "presets"], capture_output=True, text=True,
                          env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    for name in preset_names():
        assert f" {name} " in proc.stdout, name
    assert max(len(line) for line in proc.stdout.splitlines()) <= LOG_WIDTH


def test_check_table_in_80_columns_names_each_runner_whole():
    console, buf = _terminal(80)
    runners = [RunnerReport(name, status, latency_ms=1.25) for name, status in
               (("onnx-reference", "golden"), ("onnxruntime-cpu", "pass"), ("onnxruntime-cuda", "skipped"))]
    report = CheckReport(model="a-rather-long-model-file-name.onnx", reference="PyTorch", against="PyTorch",
                         independent=True, dtype="float16", tolerance=tolerance("block", "float16"), runners=runners)
    print_report(report, console)
    table_lines = buf.getvalue().split("reference: PyTorch")[0]
    assert "…" not in table_lines
    for name in ("onnx-reference", "onnxruntime-cpu", "onnxruntime-cuda"):
        assert name in table_lines, name
