"""``check`` on files other tools write: onnxruntime's contrib ops, and no ``position_ids`` input.

* A tiny Llama exported plainly, fused and lowered to ``ort`` (com.microsoft RotaryEmbedding), then
  run through onnxruntime's transformer optimizer (SimplifiedLayerNormalization in the ai.onnx
  domain): onnx.checker alone refuses it ("No Op
  registered for SimplifiedLayerNormalization"); check validates the rest, runs it on onnxruntime
  against transformers, and says why the other runners cannot run it.
* A tiny Gemma exported plainly with input_ids, attention_mask and past only (optimum's Gemma files
  have no position_ids): its tokens sit at the past length, and the reference is fed the same way.

Each correct file passes; the same file with a planted defect (a norm weight scaled, positions
shifted by 5) fails.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
import torch
from check_files import COMMON, copy, hf_config, plain_and_fused
from onnx import numpy_helper

from rope_export.check import CheckError, check
from rope_export.check.inputs import InputPlan, stress_cases
from rope_export.check.model_file import ModelFile

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


def _statuses(report) -> dict[str, tuple[str, str]]:
    return {r.runner: (r.status, r.reason) for r in report.runners}


@functools.cache
def _optimized(target: str | None = "ort") -> onnx.ModelProto:
    """The fused file lowered to ``target`` (None: our nodes kept), then onnxruntime's optimizer."""
    from onnxruntime.transformers.optimizer import optimize_model

    from rope_export.passes import lower

    # a copy: onnxruntime's optimizer edits the proto it is given, and plain_and_fused() is shared
    model = copy(plain_and_fused()[1]) if target is None else lower(plain_and_fused()[1], target)
    return optimize_model(model, model_type="gpt_neox", num_heads=4, hidden_size=32, opt_level=0).model


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf_config("llama").save_pretrained(folder)
    return folder


def test_the_premise_the_optimizer_writes_contrib_ops_the_checker_refuses(tmp_path):
    ops = {(n.domain, n.op_type) for n in _optimized().graph.node}
    assert {("", "SimplifiedLayerNormalization"), ("com.microsoft", "RotaryEmbedding")} <= ops
    onnx.save(_optimized(), tmp_path / "opt.onnx")
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(tmp_path / "opt.onnx"))


@pytest.mark.parametrize("target", ["ort", None])
def test_a_contrib_file_runs_on_onnxruntime_against_transformers(tmp_path, llama_config, target):
    """Lowered to the contrib RotaryEmbedding, or with our nodes kept (onnxruntime-cpu then lowers them to
    plain ops: onnx's version converter cannot take a file with contrib ops to opset 23)."""
    onnx.save(_optimized(target), tmp_path / "opt.onnx")
    report = check(tmp_path / "opt.onnx", RUNNERS, hf_config=llama_config, sweep=False)
    status = _statuses(report)
    assert report.against == "transformers"
    assert status["onnxruntime-cpu"][0] == "pass"
    skipped = ("onnx-reference",) if target == "ort" else ("onnx-reference", "cpu-twin")
    for runner in skipped:
        assert status[runner][0] == "skipped"
        assert "SimplifiedLayerNormalization" in status[runner][1] and "onnxruntime-cpu runs" in status[runner][1]
    if target == "ort":  # nothing for the twin to run: said before the contrib ops
        assert status["cpu-twin"] == ("skipped", "no rope_export or trt-plugin rotary node for the twin to run (the "
                                      "file was lowered to another target)")
    else:
        assert "lowered in memory to plain ops" in status["onnxruntime-cpu"][1]
    assert any("onnx.checker checked the rest" in note for note in report.notes)


def test_a_contrib_file_with_a_scaled_norm_weight_fails(tmp_path, llama_config):
    model = onnx.ModelProto()
    model.CopyFrom(_optimized())
    norm = next(n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    tensor = next(t for t in model.graph.initializer if t.name == norm.input[1])
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * 1.5, tensor.name))
    onnx.save(model, tmp_path / "bad.onnx")
    report = check(tmp_path / "bad.onnx", ("onnxruntime-cpu",), hf_config=llama_config, sweep=False)
    assert _statuses(report)["onnxruntime-cpu"][0] == "FAIL"


def test_the_checker_still_refuses_a_broken_contrib_file(tmp_path):
    model = onnx.ModelProto()
    model.CopyFrom(_optimized())
    model.graph.node[-1].input.append("no_such_value")  # read before anything defines it
    onnx.save(model, tmp_path / "broken.onnx")
    with pytest.raises(CheckError, match="fails onnx.checker: .*no_such_value"):
        check(tmp_path / "broken.onnx", ("onnxruntime-cpu",), sweep=False)


# -- no position_ids ---------------------------------------------------------------------------------

class _NoPositions(torch.nn.Module):
    """(input_ids, attention_mask, past key, past value) -> (logits, present key, present value); ``shift``
    plants a defect: positions moved by that much."""

    def __init__(self, model, shift: int = 0):
        super().__init__()
        self.model, self.shift = model, shift

    def forward(self, input_ids, attention_mask, past_key, past_value):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        cache.update(past_key, past_value, 0)
        kwargs = {}
        if self.shift:
            past = past_key.shape[2]
            kwargs["position_ids"] = (torch.arange(input_ids.shape[1]) + past + self.shift).unsqueeze(0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                         **kwargs)
        layer = out.past_key_values.layers[0]
        return out.logits, layer.keys, layer.values


def _gemma_config():
    import transformers as tf

    return tf.GemmaConfig(**COMMON, num_key_value_heads=2, head_dim=8)


@functools.cache
def _no_positions_file(shift: int = 0) -> onnx.ModelProto:
    from rope_export import hf
    from rope_export.exporting.torch_onnx import quiet_exporter

    model = hf.build_hf_model(_gemma_config(), seed=0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 4), generator=generator)
    past = [torch.randn(2, 2, 3, 8, generator=generator) for _ in range(2)]
    mask = torch.ones(2, 7, dtype=torch.int64)
    batch, seq, past_len, total = (torch.export.Dim(n) for n in ("batch", "seq", "past", "total"))
    names = ["input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.0.value"]
    with torch.no_grad(), quiet_exporter(False):
        return torch.onnx.export(_NoPositions(model, shift), (ids, mask, *past), dynamo=True, opset_version=18,
                                 input_names=names, output_names=["logits", "present.0.key", "present.0.value"],
                                 dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: total},
                                                 {0: batch, 2: past_len}, {0: batch, 2: past_len})).model_proto


@pytest.fixture(scope="module")
def gemma_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma")
    _gemma_config().save_pretrained(folder)
    return folder


def test_cases_without_position_ids_put_the_tokens_at_the_past_length():
    mf = ModelFile.open(_no_positions_file())
    assert "position_ids" not in {s.name for s in mf.inputs}
    cases, notes = stress_cases(mf, InputPlan(position_limit=128), 1 << 30)
    names = [c.name for c in cases]
    assert "decode-end-of-positions" in names and "decode-mid-positions" in names
    for case in cases:
        past = case.feeds["past_key_values.0.key"].shape[2]
        assert (case.positions[:, 0] == past).all(), case.name
        assert case.feeds["attention_mask"].shape[1] == past + case.feeds["input_ids"].shape[1]
    assert next(c for c in cases if c.name == "decode-end-of-positions").positions.max() == 127
    assert any("no position_ids input" in note for note in notes)


def test_a_file_without_position_ids_is_checked_against_transformers(tmp_path, gemma_config):
    onnx.save(_no_positions_file(), tmp_path / "gemma.onnx")
    report = check(tmp_path / "gemma.onnx", ("onnx-reference", "onnxruntime-cpu"), hf_config=gemma_config,
                   sweep=False)
    assert report.against == "transformers"
    assert {name: s for name, (s, _) in _statuses(report).items()} == {"onnx-reference": "pass",
                                                                       "onnxruntime-cpu": "pass"}
    assert "decode-end-of-positions" in report.cases


def test_a_file_whose_positions_are_shifted_fails(tmp_path, gemma_config):
    onnx.save(_no_positions_file(shift=5), tmp_path / "shifted.onnx")
    report = check(tmp_path / "shifted.onnx", ("onnxruntime-cpu",), hf_config=gemma_config, sweep=False)
    status, _ = _statuses(report)["onnxruntime-cpu"]
    assert status == "FAIL"
    errors = [s.max_abs for stats in next(r for r in report.runners).cases.values() for s in stats]
    assert np.nanmax(errors) > 1e-2
