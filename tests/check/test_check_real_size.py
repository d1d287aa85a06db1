"""check at real size, shown on a tiny model forced to external data: weights never pass through a
ModelProto for onnxruntime, the reference and the runners take turns, progress per runner; onnxruntime
runs in pieces rather than exceed the memory limit (the pieces themselves: test_check_pieces.py)."""

from __future__ import annotations

import weakref

import onnx
import pytest

pytest.importorskip("transformers")

from check_files import copy, hf_file  # noqa: E402

from rope_export.check import check, core, model_file, references  # noqa: E402

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


@pytest.fixture(scope="module")
def external_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("external") / "llama.onnx"
    onnx.save_model(copy(hf_file("llama")), path, save_as_external_data=True, location="llama.onnx.data",
                    size_threshold=1024)
    graph = onnx.load(path, load_external_data=False).graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) >= 7 and (path.parent / "llama.onnx.data").stat().st_size > 40_000  # every matrix
    return path


@pytest.fixture
def weights_never_loaded_whole(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("check loaded every external weight into a ModelProto")

    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", refuse)


def test_runners_read_the_weights_from_the_path(external_file, weights_never_loaded_whole):
    messages = []
    report = check(external_file, RUNNERS, max_in_memory_gb=0, progress=messages.append)
    assert report.passed, report.failure_message()
    status = {r.runner: r for r in report.runners}
    for name in ("onnx-reference", "cpu-twin"):  # they need the whole ModelProto: skipped above the limit
        assert status[name].status == "skipped"
        assert "needs the whole model in memory as a ModelProto" in status[name].reason
        assert status[name].sweep.status == "pass"  # the rotary nodes alone still run on them (a few KB)
    ort = status["onnxruntime-cpu"]
    assert ort.status == "pass" and ort.max_abs < 1e-4 and "lowered in memory" in ort.reason
    assert any("in external data" in note for note in report.notes)
    assert any(m.startswith("[3/3] onnxruntime-cpu: running") for m in messages)  # progress per runner
    assert any(m.startswith("[3/3] onnxruntime-cpu: comparing with the reference") for m in messages)


def test_the_lowered_file_runs_from_its_own_path(external_file, tmp_path, weights_never_loaded_whole):
    from rope_export.passes import lower

    lowered = lower(onnx.load(external_file, load_external_data=False), "onnx")  # graph only; data stays external
    path = external_file.parent / "llama.onnx-lowered.onnx"
    onnx.save_model(lowered, path)
    report = check(path, ("onnxruntime-cpu",), max_in_memory_gb=0)
    assert report.passed and "session on the file's path" in report.runners[0].reason


def test_the_reference_is_freed_before_each_runner_starts(external_file, monkeypatch):
    monkeypatch.setattr(model_file, "BIG_WEIGHTS", 0)  # collect as a real-size check does
    built = []
    build = references.TransformersReference._build

    def remember(self):
        model = build(self)
        built.append(weakref.ref(model))
        return model

    def make_runner(*args, **kwargs):
        assert built and built[0]() is None, "the transformers model is still alive while a runner is built"
        return real_make_runner(*args, **kwargs)

    real_make_runner = core.make_runner
    monkeypatch.setattr(references.TransformersReference, "_build", remember)
    monkeypatch.setattr(core, "make_runner", make_runner)
    report = check(external_file, ("onnxruntime-cpu",), seq=4, long_seq=8)
    assert report.passed and len(built) == 1
    assert set(report.cases) >= {"prefill", "long-sequence"} and "seq 4" in report.inputs
    assert "long sequence 8" in report.inputs  # short sequences by default, longer on request


def test_onnxruntime_cpu_runs_in_pieces_rather_than_exceed_the_memory_limit():
    from check_files import preset_file

    from rope_export.check.pieces import StreamedRunner
    from rope_export.check.runners import Limits, make_runner, ort_cpu_bytes

    mf = model_file.ModelFile.open(preset_file("fp16", 64))
    half = sum(model_file.tensor_nbytes(t) for t in mf.proto.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT16)
    assert half > 0 and ort_cpu_bytes(mf) >= 3 * half  # half-precision weights get a float32 copy on the CPU
    runner, note = make_runner("onnxruntime-cpu", mf, limits=Limits(memory=ort_cpu_bytes(mf) - 1))
    assert isinstance(runner, StreamedRunner) and max(p.session_bytes for p in runner.pieces) < ort_cpu_bytes(mf)
    assert "keeps" not in note and "more than the" in note
    runner, _ = make_runner("onnxruntime-cpu", mf, limits=Limits(memory=ort_cpu_bytes(mf)))
    assert runner.name == "onnxruntime-cpu" and not isinstance(runner, StreamedRunner)


def test_a_whole_model_is_held_to_one_blocks_tolerance_per_layer_in_quadrature():
    from rope_export.op.tolerances import for_layers, tolerance

    block = tolerance("block", "float16")
    assert for_layers(block, 16).atol == pytest.approx(4 * block.atol) and for_layers(block, 1) == block
    report = check(hf_file("llama"), ("onnxruntime-cpu",), sweep=False)  # one layer: the block's own
    assert report.tolerance == tolerance("block", "float32")
