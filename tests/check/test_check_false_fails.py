"""check never fails a correct file (and still fails a broken one): the files users reported.

Each file is built here, the way the user built it: a rotate-half block written from scratch (its
positions input called ``pos``), exported with ``export_module`` or plainly then fused; a file with
static shapes written with onnx.helper. Each correct file PASSes; a planted wrong cache row or a
swapped weight in the same file FAILs.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from check_files import change_cache_rows
from onnx import numpy_helper
from user_blocks import MAX_POS, RotateHalfBlock, example, sliced_table_file, static_one_node_file, swap_weights

from rope_export.check import check
from rope_export.op.contract import DOMAIN

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


@functools.cache
def rotate_half_export() -> onnx.ModelProto:
    from rope_export import export_module

    return export_module(RotateHalfBlock().eval(), example(), input_names=["x", "pos"]).model


@functools.cache
def rotate_half_plain_and_fused() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    from rope_blocks import export_plain

    from rope_export.passes import fuse

    plain = export_plain(RotateHalfBlock().eval(), example())
    return plain, fuse(plain)


def _stored_cos_rows(model) -> int:
    node = next(n for n in model.graph.node if n.domain == DOMAIN)
    return next(list(i.dims) for i in model.graph.initializer if i.name == node.input[1])[0]


# -- a rotate-half block written from scratch --------------------------------------------------------

def test_rotate_half_block_from_export_module_passes_every_row():
    """The node's positions come from an input called ``pos``: found by data flow, not by name."""
    report = check(rotate_half_export(), RUNNERS)
    assert report.passed, report.failure_message()
    swept = [r.sweep for r in report.runners if r.status == "pass"]
    assert swept and all(s.status == "pass" and s.positions == MAX_POS for s in swept)


def test_rotate_half_block_plain_then_fused_passes_against_the_plain_file(tmp_path):
    plain, fused = rotate_half_plain_and_fused()
    onnx.save_model(plain, tmp_path / "plain.onnx")
    report = check(fused, RUNNERS, reference=tmp_path / "plain.onnx")
    assert report.passed, report.failure_message()
    assert all(r.sweep.status == "pass" and r.sweep.positions == MAX_POS for r in report.runners)


@pytest.mark.parametrize("row", [1, 300])
def test_rotate_half_block_with_a_wrong_cache_row_fails(row):
    model = rotate_half_export()
    assert _stored_cos_rows(model) == MAX_POS
    report = check(change_cache_rows(model, row, "sin", how=lambda v: v * 1.01 + 1e-3), RUNNERS)
    assert not report.passed
    (bad,) = [t for t in report.tables if not t.passed]
    assert bad.bad_rows == [(row, row)]


def test_rotate_half_block_fused_with_swapped_weights_fails_against_the_plain_file(tmp_path):
    plain, fused = rotate_half_plain_and_fused()
    onnx.save_model(plain, tmp_path / "plain.onnx")
    report = check(swap_weights(fused), ("onnxruntime-cpu",), reference=tmp_path / "plain.onnx")
    assert not report.passed and report.runners[0].status == "FAIL"


# -- static shapes ------------------------------------------------------------------------------------

def test_static_shapes_pass_with_the_files_own_dims():
    report = check(static_one_node_file(), RUNNERS)
    assert report.passed, report.failure_message()
    assert "case long-sequence left out: the file fixes the sequence at 3 tokens" in report.notes
    assert any("3 tokens at a time" in n for n in report.notes)
    for r in report.runners:
        assert r.sweep.status in ("pass", "golden") and r.sweep.positions == 64


@pytest.mark.parametrize("row", [0, 62, 63])
def test_static_shapes_with_a_wrong_cache_row_fail(row):
    report = check(change_cache_rows(static_one_node_file(), row, "cos", how=lambda v: v + 1e-2), RUNNERS)
    assert not report.passed
    (bad,) = [t for t in report.tables if not t.passed]
    assert bad.bad_rows == [(row, row)] and bad.against == "a fitted rotation table"


def test_static_position_ids_are_fed_as_the_file_declares():
    """Every case's feeds have the file's static shapes."""
    from rope_export.check.inputs import InputPlan, stress_cases
    from rope_export.check.model_file import ModelFile

    cases, _ = stress_cases(ModelFile.open(static_one_node_file()), InputPlan(position_limit=64), 1 << 30)
    for case in cases:
        assert case.feeds["x"].shape == (1, 1, 3, 4) and case.feeds["position_ids"].shape == (1, 3)
        assert np.array_equal(case.feeds["position_ids"][0], case.positions[0])  # three distinct positions


# -- per-token caches sliced from a table (Meta's freqs_cis[:seqlen]) ------------------------------------

def test_per_token_caches_sliced_from_a_table_are_swept_over_its_rows_only():
    """Swept past the table, the node would get [1, 4096, D/2] X and [1, 512, D/2] caches: the contract's
    error, reported as a FAIL of a correct file."""
    report = check(sliced_table_file(), RUNNERS)
    assert report.passed, report.failure_message()
    for r in report.runners:
        assert r.sweep.status == "golden" or (r.sweep.status == "pass" and r.sweep.positions == MAX_POS)
    assert {t.name for t in report.tables} == {"cos_table, sin_table"} and all(t.passed for t in report.tables)
    assert "long-sequence" in report.cases  # X's static axis 1 (2 heads) is no sequence length


def test_per_token_caches_sliced_from_a_table_with_a_wrong_row_fail():
    model = sliced_table_file()
    table = next(i for i in model.graph.initializer if i.name == "sin_table")
    values = numpy_helper.to_array(table).copy()
    values[400] *= 1.01
    table.CopyFrom(numpy_helper.from_array(values, table.name))
    report = check(model, ("cpu-twin",))
    assert not report.passed
    (bad,) = [t for t in report.tables if not t.passed]
    assert bad.bad_rows == [(400, 400)]
