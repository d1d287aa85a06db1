"""SIGINT and SIGTERM sent to a real ``rope-export export`` while it writes (issue 16).

Before the fix SIGTERM left a 16 MB ``.model.onnx.XXXX.tmp`` beside the output and SIGINT printed
a KeyboardInterrupt traceback. Now both unwind like an exception: the atomic writers remove their
temporary files, the command says so in one line and exits with 128 + the signal number, and an
earlier model/data pair at the same path is left whole (never a new model over old data).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from rope_export.files import onnx_files
from rope_export.presets import export as preset_export

CACHE_LEN = 262144  # 16 MB of float32 cos/sin: the write takes long enough to be caught in the act
SMALL_THRESHOLD = 1 << 20  # external data from 1 MB on (instead of 2 GB), set in the child process

CHILD = """
import sys
import rope_export.files.onnx_files as onnx_files
if sys.argv[1] == "external":
    onnx_files.EXTERNAL_DATA_THRESHOLD = {threshold}
from rope_export.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def _export_args(out: Path, seed: int) -> list[str]:
    return ["export", "--preset", "tiny", "--cache-len", str(CACHE_LEN), "--seed", str(seed), "-o", str(out)]


def _temp_files(folder: Path, min_size: int = 0) -> list[str]:
    names = []
    for entry in os.scandir(folder):
        try:
            if entry.name.endswith(".tmp") and entry.stat().st_size >= min_size:
                names.append(entry.name)
        except FileNotFoundError:  # renamed or removed meanwhile
            pass
    return sorted(names)


def _interrupt_while_writing(folder: Path, mode: str, args: list[str], signum: int) -> subprocess.CompletedProcess:
    """Start the CLI; send ``signum`` while it writes a temporary file beside the output.

    "While it writes": once a temporary file has data (external data is written tensor by
    tensor), or 5 ms after one appeared (a plain model is serialized in memory first, for tens of
    milliseconds at this size). Not the instant it appears: the atomic writers have a few
    bytecodes between creating the file and entering their cleanup block, a separate, narrower race
    that this test does not aim at."""
    code = CHILD.format(threshold=SMALL_THRESHOLD)
    # cwd: not the output folder (export's external-data save fails there: onnx looks for its
    # temporary data file relative to the working directory and finds it; reported separately).
    proc = subprocess.Popen([sys.executable, "-c", code, mode, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=folder.parent)
    deadline = time.monotonic() + 240
    sent = False
    while proc.poll() is None and time.monotonic() < deadline:
        if _temp_files(folder, min_size=1 if mode == "external" else 0):
            if mode != "external":
                time.sleep(0.005)
            proc.send_signal(signum)
            sent = True
            break
        time.sleep(0.0005)
    out, err = proc.communicate(timeout=240)
    if not sent:
        pytest.fail(f"no temporary file was seen before the export ended (rc={proc.returncode}): {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_write_leaves_no_temporary_file(tmp_path, signum):
    out = tmp_path / "model.onnx"
    result = _interrupt_while_writing(tmp_path, "plain", _export_args(out, 0), signum)
    name = signal.Signals(signum).name
    assert result.returncode == 128 + signum, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines == [f"rope-export export: interrupted by {name}; files are written atomically, so an output is "
                     "either complete or absent (no temporary file is left)"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert _temp_files(tmp_path) == []
    assert not out.exists()  # caught while the temporary file was being written: nothing renamed


def test_sigterm_during_an_external_data_write_keeps_the_earlier_pair_whole(tmp_path, monkeypatch):
    """An earlier export (seed 0) sits at the path; a new one (seed 1) is stopped while writing.
    The pair on disk must then be the earlier one, byte for byte (or, had the new one finished,
    the new model with the new data): never the new model over the old data."""
    out = tmp_path / "model.onnx"
    data = tmp_path / "model.onnx.data"
    monkeypatch.setattr(onnx_files, "EXTERNAL_DATA_THRESHOLD", SMALL_THRESHOLD)
    preset_export.export("tiny", out, seed=0, cache_len=CACHE_LEN)
    assert data.is_file()
    old_model, old_data = out.read_bytes(), data.read_bytes()

    result = _interrupt_while_writing(tmp_path, "external", _export_args(out, 1), signal.SIGTERM)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "interrupted by SIGTERM" in result.stderr
    assert _temp_files(tmp_path) == []
    new_model, new_data = out.read_bytes(), data.read_bytes()
    assert (new_model == old_model) == (new_data == old_data), "a model and a data file from different exports"
    onnx.checker.check_model(str(out), full_check=True)  # the pair loads: every offset lies in its data file
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "model.onnx.data"]
