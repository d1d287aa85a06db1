"""Progress steps with their time and peak memory (rope_export.common.steps)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from rope_export.common.bounds import format_bytes
from rope_export.common.steps import SAMPLE_PERIOD_S, StepLog, rss_bytes


def test_each_message_is_a_step_with_its_own_time_and_peak(tmp_path):
    shown, details = [], []
    log = StepLog(shown.append, details.append)
    log("small step")
    time.sleep(0.1)
    log("big step")
    block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
    time.sleep(0.15)  # several sampling periods
    del block
    log.detail("halfway")
    log("small again")
    time.sleep(0.05)
    steps = log.finish()
    assert [s.name for s in steps] == ["small step", "big step", "small again"] == shown
    assert details == ["halfway"]
    assert steps[0].seconds >= 0.1 and steps[1].seconds >= 0.15
    assert steps[1].peak_rss - steps[0].peak_rss > 250 * 2**20  # the allocation is seen in its own step ...
    assert steps[2].peak_rss < steps[1].peak_rss - 200 * 2**20  # ... and not in the next one
    assert log.peak_rss == steps[1].peak_rss
    log.add_files([(tmp_path / "m.onnx", 123)])
    log.write_json(tmp_path / "s.json")
    data = json.loads((tmp_path / "s.json").read_text())
    assert [s["name"] for s in data["steps"]] == shown and data["files"] == [{"path": str(tmp_path / "m.onnx"),
                                                                              "bytes": 123}]
    time.sleep(5 * SAMPLE_PERIOD_S)
    assert not [t for t in threading.enumerate() if t.name == "rope-export-rss"]  # the sampler stopped


def test_rss_and_sizes_for_people():
    assert 10 * 2**20 < rss_bytes() < 64 * 2**30
    assert [format_bytes(n) for n in (96, 812_000, 31_500_000, 2_471_628_800, None)] == \
        ["96 B", "812.0 kB", "31.5 MB", "2.47 GB", "-"]
