"""A write killed at every step it takes on disk leaves the old model and data or the new ones, never a mix (issue 40).

Before the fix, a write replacing a model with external data moved ``m.onnx.data`` first, then ``m.onnx``: a process
killed between the two left the old model reading the new weights, silently. ``kill_steps.py`` (run in a process
of its own, forking one child per step) stops ``onnx_files.write`` before each call that changes the file system,
with SIGKILL, SIGTERM and SIGINT, and reads what is on disk with onnx (each tensor from the file its ``location``
names). Each model records its seed, so a model reading another write's weights shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

HERE = Path(__file__).parent
OLD, NEW, AFTER = "seed 1", "seed 2", "seed 3"
DATA = {"single": ["{}"], "per-tensor": ["{}/"], "never": []}


def kill_at_every_step(tmp_path: Path, old: str, new: str, direct_io: str) -> tuple[dict, list[dict]]:
    result = subprocess.run([sys.executable, str(HERE / "kill_steps.py"), str(tmp_path), old, new, direct_io,
                             "SIGKILL,SIGTERM,SIGINT"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    first, *runs = (json.loads(line) for line in result.stdout.splitlines())
    return first, runs


def listing_of(layout: str, data_name: str) -> list[str]:
    return sorted(["m.onnx"] + [d.format(data_name) for d in DATA[layout]])


def check_every_step(tmp_path, old, new, direct_io):
    undisturbed, runs = kill_at_every_step(tmp_path, old, new, direct_io)
    steps = undisturbed["steps"]
    # the write path under test: DirectFile's pwrite past the page cache, or plain writes through it
    assert any(s.startswith("pwrite") for s in steps) == (direct_io == "1" and new != "never"), steps
    old_listing = listing_of(old, "m.onnx.data")
    new_data = "m.onnx.2.data" if old != "never" else "m.onnx.data"  # the name the old model does not read
    assert undisturbed["found"] == NEW and undisturbed["listing"] == listing_of(new, new_data)
    assert len(runs) == 3 * len(steps)
    for run in runs:
        where = f"{run['signal']} before step {run['step']} ({run['before']})"
        assert run["found"] in (OLD, NEW), f"{where}: {run['found']}"
        if run["signal"] == "SIGKILL":
            assert run["status"] == 137, where
            # the next write of the path finishes and leaves only its own pair: the killed write's staging
            # folder and any data file no model reads are gone
            assert run["status_after"] == 0 and run["found_after"] == AFTER, f"{where}: then {run['found_after']}"
            assert [n for n in run["listing_after"] if n != "m.onnx"] in ([], ["m.onnx.data"], ["m.onnx.data/"],
                                                                          ["m.onnx.2.data"], ["m.onnx.2.data/"]), where
        else:  # SIGINT and SIGTERM unwind: exit 128 + n, nothing but one whole pair left
            assert run["status"] == {"SIGTERM": 143, "SIGINT": 130}[run["signal"]], where
            want = old_listing if run["found"] == OLD else listing_of(new, new_data)
            assert run["listing"] == want, f"{where}: {run['listing']}"
    # the case the issue reported: killed between the data's rename and the model's
    between = [r for r in runs if r["signal"] == "SIGKILL" and r["before"] == "replace m.onnx m.onnx"]
    assert len(between) == 1 and between[0]["found"] == OLD


@pytest.mark.parametrize(("old", "new", "direct_io"), [("single", "single", "1"), ("per-tensor", "per-tensor", "0")],
                         ids=["single-past-page-cache", "per-tensor-page-cache"])
def test_a_write_killed_at_any_step_leaves_the_old_pair_or_the_new_one(tmp_path, old, new, direct_io):
    check_every_step(tmp_path, old, new, direct_io)


LAYOUT_CHANGES = [(old, new) for old in ("single", "per-tensor", "never") for new in ("single", "per-tensor", "never")
                  if (old, new) != ("never", "never")]


@pytest.mark.slow
@pytest.mark.parametrize("direct_io", ["1", "0"], ids=["past-page-cache", "page-cache"])
@pytest.mark.parametrize(("old", "new"), LAYOUT_CHANGES, ids=[f"{o}-to-{n}" for o, n in LAYOUT_CHANGES])
def test_every_layout_change_killed_at_any_step(tmp_path, old, new, direct_io):
    check_every_step(tmp_path, old, new, direct_io)


def test_the_data_name_alternates_and_the_old_data_goes(tmp_path):
    """The data goes under the name the replaced model does not read; the replaced model's data is removed,
    also when the new model keeps its weights inside; a data file of another tool's is left alone."""
    from test_onnx_files import listing, mlp_model

    from rope_export.files import onnx_files

    path = tmp_path / "m.onnx"
    names = []
    for seed, external in enumerate(["single", "single", "per-tensor", "never", "single"]):
        written = onnx_files.write(mlp_model(seed=seed), path, external=external)
        names.append(listing(tmp_path))
        assert [p.name for p, _ in written.files] == [p.name for p, _ in onnx_files.output_files(path)]
    assert names == [["m.onnx", "m.onnx.data"], ["m.onnx", "m.onnx.2.data"], ["m.onnx", "m.onnx.data/"], ["m.onnx"],
                     ["m.onnx", "m.onnx.data"]]
    (tmp_path / "m.onnx_data").write_bytes(b"another tool's")
    onnx_files.write(mlp_model(seed=9), path, external="never")
    assert listing(tmp_path) == ["m.onnx", "m.onnx_data"]
    onnx_files.remove(path)
    assert listing(tmp_path) == ["m.onnx_data"]


def test_a_killed_writes_folder_is_removed_only_when_its_process_is_gone(tmp_path):
    """remove_abandoned takes a staging folder nobody holds, never a live write's."""
    from rope_export.common import fileio

    target = tmp_path / "m.onnx"
    (tmp_path / ".m.onnx.abcd1234.tmp").mkdir()  # a killed write's: no lock
    (tmp_path / ".m.onnx.abcd1234.tmp" / "m.onnx.data").write_bytes(b"x" * 100)
    (tmp_path / ".other.onnx.abcd1234.tmp").mkdir()  # another target's
    with fileio.staging_dir(target) as live:
        (live / "m.onnx").write_bytes(b"y")
        assert fileio.remove_abandoned(target) == [".m.onnx.abcd1234.tmp"]
        assert live.is_dir()
    assert sorted(os.listdir(tmp_path)) == [".other.onnx.abcd1234.tmp"]


def test_a_write_that_another_replaced_meanwhile_is_refused_and_leaves_the_other(tmp_path):
    """Two writes of one path at once: the second to finish would move its data onto the name the first one's
    model reads; it stops instead, and the first one's pair stays whole."""
    from test_onnx_files import listing, mlp_model, weights_of

    from rope_export.files import onnx_files
    from rope_export.files.commit import ReplacedMeanwhile

    path = tmp_path / "m.onnx"
    onnx_files.write(mlp_model(seed=1), path, external="single")

    def meanwhile(message):  # called while the outer write stages its files
        if message.startswith("writing"):
            onnx_files.write(mlp_model(seed=2), path, external="single")

    with pytest.raises(ReplacedMeanwhile, match="another process replaced it while this write was under way"):
        onnx_files.write(mlp_model(seed=3), path, external="single", progress=meanwhile)
    assert listing(tmp_path) == ["m.onnx", "m.onnx.2.data"]
    want = {t.name: t for t in mlp_model(seed=2).graph.initializer}
    assert all(np.array_equal(array, numpy_helper.to_array(want[name])) for name, array in weights_of(path).items())
