"""Half precision with trained-like statistics (tests/planted.py): fp16 and bf16 exports pass on every runner and
every lowering, after every layer, and each float32 step undone is caught and named.

What the file states in float32 (rope_export.exporting.precision): the norms' statistics (as Casts, so that no
runner can skip them) and the attention softmax. Undone:

* the norms' statistics in half: float16 squares of the massive channels overflow and bfloat16 sums over the
  hidden size lose the small terms; the runners that follow the file fail and check names the norm as the file's
  loss of precision;
* the norms fused with stash_type 1 (the file as torch.onnx writes it, correct): onnx.reference ignores
  stash_type, so in float16 onnx-reference and the CPU twin are named as the runners at fault, not the file;
* the softmax in half: onnxruntime and NumPy accumulate half sums in float32, so no runner here measures the
  loss, and check lists the op the file states below PyTorch's precision.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import onnx  # noqa: E402
from planted import (  # noqa: E402
    CASES,
    LAYERS,
    norm_fused,
    norm_statistics_in_half,
    planted_file,
    planted_folder,
    softmax_in_half,
)

from rope_export.check import check  # noqa: E402
from rope_export.passes import lower  # noqa: E402

RUNNERS = ("onnxruntime-cpu", "onnx-reference", "cpu-twin")
# runners that run each form in each dtype here; the others must say why not
RUNS = {("fp16", None): RUNNERS, ("fp16", "trt-plugin"): ("onnx-reference", "cpu-twin"),
        ("fp16", "onnx"): ("onnxruntime-cpu", "onnx-reference"), ("fp16", "ort"): ("onnxruntime-cpu",),
        ("fp16", "decomposed"): ("onnxruntime-cpu", "onnx-reference"),
        ("bf16", None): ("onnx-reference", "cpu-twin"), ("bf16", "trt-plugin"): ("onnx-reference", "cpu-twin"),
        ("bf16", "onnx"): ("onnx-reference",), ("bf16", "ort"): (), ("bf16", "decomposed"): ("onnx-reference",)}
WHY_NOT = {"onnxruntime-cpu": ("no bfloat16 kernel for", "cannot run the TensorRT plugin node"),
           "onnx-reference": ("contrib ops",), "cpu-twin": ("lowered to another target",)}


def _check(model, dtype):
    return check(model, RUNNERS, **CASES)


def test_planted_exports_state_the_float32_steps():
    """What the envelope test relies on, in the graph: every norm on a float32 input, every softmax on float32."""
    for dtype in ("fp16", "bf16"):
        graph = planted_file(dtype).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
        norms = [n for n in graph.node if n.op_type == "RMSNormalization"]
        softmax = [n for n in graph.node if n.op_type == "Softmax"]
        assert len(norms) == 2 * LAYERS + 1 and len(softmax) == LAYERS
        assert {types[n.input[0]] for n in [*norms, *softmax]} == {onnx.TensorProto.FLOAT}


def within_envelope(report, dtype: str, target: str | None) -> None:
    """The rule these tests hold a planted export to: every runner that can run it passes, logits and every
    layer within PyTorch's envelope, nothing stated below PyTorch's precision; the others say why not."""
    runs = RUNS[dtype, target]
    status = {r.runner: r for r in report.runners}
    assert [r for r in RUNNERS if status[r].status == "pass"] == list(runs), report.failure_message()
    for name in set(RUNNERS) - set(runs):
        assert status[name].status == "skipped" and any(w in status[name].reason for w in WHY_NOT[name]), \
            status[name].reason
    assert report.precision == []  # nothing stated below PyTorch's precision
    if not runs:  # bf16 lowered to onnxruntime's contrib op: nothing here runs it, and check says so
        assert not report.passed and "no runner could run this file" in report.failure_message()
        return
    assert report.passed and report.rule is not None, report.failure_message()
    for name in runs:
        layers = status[name].layers
        assert layers is not None and layers.first_outside is None and len(layers.errors) == LAYERS
        assert 0 < max(layers.errors)  # half-precision rounding, with the planted statistics in play
        logits = [s for stats in status[name].cases.values() for s in stats if s.output == "logits"]
        assert logits and all(s.passed and s.max_abs <= s.bound for s in logits)


@pytest.mark.parametrize(("dtype", "target"), list(RUNS))
def test_planted_file_is_within_pytorchs_envelope_on_every_runner(dtype, target):
    model = planted_file(dtype) if target is None else lower(planted_file(dtype), target)
    within_envelope(_check(model, dtype), dtype, target)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_norm_statistics_in_half_fail_and_the_file_is_named(dtype):
    report = _check(norm_statistics_in_half(planted_file(dtype)), dtype)
    with pytest.raises(AssertionError):
        within_envelope(report, dtype, None)
    assert not report.passed
    failing = [r for r in report.runners if r.status == "FAIL"]
    assert {r.runner for r in failing} >= {"onnx-reference", "cpu-twin"}
    for r in failing:
        assert r.fault is not None and r.fault.fault == "file" and not r.fault.defect
        assert r.fault.first.stage.kind == "norm" and r.fault.first.stage.stated == dtype.replace("fp", "float") \
            .replace("bf16", "bfloat16") and r.fault.first.pytorch_precision == "float32"
        assert "the file loses precision at input_layernorm in decoder layer 0" in report.failure_message()
    assert any(f["op"] == "input_layernorm" for f in report.precision)


def test_fused_norm_is_onnx_references_fault_not_the_files():
    report = _check(norm_fused(planted_file("fp16")), "fp16")
    with pytest.raises(AssertionError):
        within_envelope(report, "fp16", None)
    status = {r.runner: r for r in report.runners}
    for name in ("onnx-reference", "cpu-twin"):
        r = status[name]
        assert r.status == "runner fault", (r.status, r.reason)
        assert f"runner {name} computes input_layernorm in decoder layer 0 less precisely than the file states" \
            in r.reason and "stash_type float32" in r.reason
        assert r.fault.float32_checked and r.fault.float32_first is None
    assert report.precision == []  # the file states float32 statistics
    assert status["onnxruntime-cpu"].status == "pass" and report.passed  # onnxruntime honours stash_type


def test_fused_norm_in_bfloat16_is_never_the_files_fault():
    """No float16 overflow: onnx.reference's bfloat16 statistics lose only the small terms of a sum over the hidden
    size, which this hidden size may or may not show; whichever, the file is not blamed (onnxruntime cannot run
    bfloat16 here, so no runner may have computed the file as it states)."""
    report = _check(norm_fused(planted_file("bf16")), "bf16")
    for r in report.runners:
        assert r.status in ("pass", "runner fault", "skipped"), (r.runner, r.status, r.reason)
    assert report.precision == []


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_softmax_in_half_is_listed_below_pytorchs_precision(dtype):
    report = _check(softmax_in_half(planted_file(dtype)), dtype)
    with pytest.raises(AssertionError):
        within_envelope(report, dtype, None)
    (finding,) = report.precision
    assert finding["op"] == "softmax" and finding["pytorch_computes_in"] == "float32"
    assert finding["layers"] == list(range(LAYERS))
    assert any("the file states less precision than PyTorch at softmax" in note for note in report.notes)


@pytest.mark.slow
@pytest.mark.parametrize("undone", ["softmax", "norm"])
def test_an_export_without_one_float32_step_fails_the_envelope(undone, monkeypatch):
    """The exporter itself with one of its float32 steps switched off: the envelope test above fails."""
    from rope_export import hf
    from rope_export.exporting import precision

    if undone == "softmax":  # torchlib's own softmax translation
        monkeypatch.setattr(precision, "translations", lambda: {})
    else:  # torch.onnx's fused norm, float32 in stash_type only
        monkeypatch.setattr(precision, "state_norm_precision", lambda model: 0)
    folder = planted_folder("fp16")
    model = hf.export_hf(hf.build_hf_model(folder, dtype="fp16"), weights=str(folder)).model
    with pytest.raises(AssertionError):
        within_envelope(_check(model, "fp16"), "fp16", None)


@pytest.mark.slow
def test_kv_buffer_attention_states_a_float32_softmax():
    """export --kv-buffer's ONNX Attention: softmax_precision float32, as transformers computes it; onnxruntime runs
    it and matches transformers' float16 run within its own error against float32."""
    import numpy as np
    import torch

    from rope_export import hf
    from rope_export.runtimes.contract_runners import to_numpy

    folder = planted_folder("fp16")
    model = hf.build_hf_model(folder, dtype="fp16")
    result = hf.export_hf(model, kv_buffer=True, weights=str(folder))
    attention = [n for n in result.model.graph.node if n.op_type == "Attention"]
    assert len(attention) == LAYERS
    assert all(onnx.helper.get_attribute_value(a) == 1 for n in attention for a in n.attribute
               if a.name == "softmax_precision")
    import onnxruntime as ort

    session = ort.InferenceSession(lower(result.model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    ids = torch.tensor([[3, 9, 17, 3, 40, 41, 3, 5]])  # token 3 and others: sinks among them or not
    feeds = dict(zip([i.name for i in session.get_inputs()],
                     [ids.numpy(), np.arange(8)[None], np.ones((1, 8), np.int64),
                      *[np.zeros((1, 2, 16, 32), np.float16) for _ in range(2 * LAYERS)]], strict=True))
    got = session.run(None, feeds)[0].astype(np.float64)
    with torch.no_grad():
        half = to_numpy(model(input_ids=ids).logits).astype(np.float64)
        full = hf.build_hf_model(folder, dtype="fp32")(input_ids=ids).logits.numpy().astype(np.float64)
    assert np.abs(got - full).max() <= 2 * np.abs(half - full).max() + 2e-3
