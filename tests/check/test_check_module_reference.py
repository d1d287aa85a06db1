"""A file of ``export_module`` is compared with PyTorch: the eager outputs it records for the example,
or the module itself given to ``check(file, module=..., args=...)``; a changed weight FAILs both ways."""

from __future__ import annotations

import base64
import functools

import onnx
import pytest
from check_files import copy
from user_blocks import ImplicitPositionsBlock, RotateHalfBlock, example, swap_weights

from rope_export import export_module
from rope_export.check import CheckError, check
from rope_export.check.module_reference import RECORDED_CASE

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


@functools.cache
def exported() -> onnx.ModelProto:
    return export_module(RotateHalfBlock().eval(), example(), input_names=["x", "pos"]).model


def test_recorded_eager_outputs_are_compared_on_every_runner():
    report = check(exported(), RUNNERS)
    assert report.passed, report.failure_message()
    assert report.against == "onnx-reference and PyTorch's recorded outputs" and not report.independent
    for r in report.runners:
        assert r.status == "pass" and RECORDED_CASE in r.cases and r.cases[RECORDED_CASE][0].max_abs < 1e-5


def test_swapped_weights_fail_on_the_recorded_example():
    """The runners agree with each other on the stress cases; PyTorch's recorded outputs tell them wrong."""
    report = check(swap_weights(exported()), RUNNERS)
    assert not report.passed
    for r in report.runners:
        failed = {name for name, stats in r.cases.items() if any(not s.passed for s in stats)}
        assert r.status == "FAIL" and failed == {RECORDED_CASE}


def test_the_module_given_to_check_is_the_reference_on_every_case():
    report = check(exported(), RUNNERS, module=RotateHalfBlock(), args=example())
    assert report.passed, report.failure_message()
    assert report.against == "PyTorch" and report.independent
    assert {"prefill", "long-sequence", "prefill-end-of-positions", RECORDED_CASE} <= set(report.cases)
    assert "past-end-of-positions" not in report.cases  # the module cannot index past its table


def test_a_module_with_another_weight_fails():
    other = RotateHalfBlock()
    other.wq.weight.data[0, 0] += 0.1
    report = check(exported(), ("onnxruntime-cpu",), module=other, args=example())
    assert not report.passed and report.runners[0].status == "FAIL"
    assert len(report.runners[0].failures()) >= 4  # every case, not the recorded one only


def test_positions_computed_in_the_graph_are_swept_as_the_node_reads_them():
    """No positions input: the node reads arange over the sequence, also in the run past the end."""
    model = export_module(ImplicitPositionsBlock().eval(), (example()[0],)).model
    report = check(model, RUNNERS)
    assert report.passed, report.failure_message()
    for r in report.runners:
        assert r.sweep.status == "pass" and r.sweep.positions == 512


def test_a_damaged_recording_is_one_line_naming_the_key():
    model = copy(exported())
    prop = next(p for p in model.metadata_props if p.key == "rope_export.module_example")
    prop.value = base64.b64encode(b"not an npz").decode()
    with pytest.raises(CheckError, match="metadata rope_export.module_example is not the example"):
        check(model, ("onnxruntime-cpu",))


def test_cli_check_module_reruns_the_export_factory(tmp_path, capsys):
    import user_blocks

    from rope_export import cli

    path = tmp_path / "block.onnx"
    assert cli.main(["export", "--module", f"{user_blocks.__file__}:rotate_half_factory", "-o", str(path)]) == 0
    base = ["check", str(path), "--runners", "onnxruntime-cpu", "--module"]
    assert cli.main([*base, f"{user_blocks.__file__}:rotate_half_factory"]) == 0
    assert "against PyTorch" in " ".join(capsys.readouterr().out.split())
    assert cli.main([*base, f"{user_blocks.__file__}:rotate_half_other_weights_factory"]) == 1
    assert "runner onnxruntime-cpu disagrees with PyTorch on prefill" in capsys.readouterr().err
    assert cli.main([*base, f"{user_blocks.__file__}:no_such_factory"]) == 2
    assert "has no callable 'no_such_factory'" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
def test_every_lowering_keeps_the_recorded_example_and_its_verdict(target):
    from rope_export.passes import lower

    report = check(lower(exported(), target), ("onnxruntime-cpu",))
    assert report.passed, report.failure_message()
    assert RECORDED_CASE in report.runners[0].cases
    broken = check(lower(swap_weights(exported()), target), ("onnxruntime-cpu",))
    assert not broken.passed and broken.runners[0].status == "FAIL"
