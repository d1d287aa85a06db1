"""Error per decoder layer and the pass rule measured against PyTorch's own error (fp16 transformers files).

A three-layer fp16 Llama exported by rope-export: clean, it passes by the measured rule and stays in
PyTorch's envelope after every layer; with one layer's rotary nodes fed the next cache row, check
fails and names that layer, in one onnxruntime session and run in pieces alike.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

transformers = pytest.importorskip("transformers")

from rope_export import cli  # noqa: E402
from rope_export.check import check  # noqa: E402
from rope_export.check.layer_errors import _layer_of, layer_outputs  # noqa: E402
from rope_export.op.contract import DOMAIN, OP_TYPE  # noqa: E402
from rope_export.op.tolerances import PYTORCH_FACTOR  # noqa: E402

LAYERS = 3
SMALL = dict(runners=("onnxruntime-cpu",), sweep=False, batch=1, seq=4, past=2, long_seq=8)


@functools.cache
def fp16_file() -> onnx.ModelProto:
    from rope_export import hf

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return hf.export_hf(hf.build_hf_model(config, seed=0, dtype="fp16")).model


def next_cache_row_in_layer(model: onnx.ModelProto, layer: int) -> onnx.ModelProto:
    """A copy where the rotary nodes of one decoder layer get the next cache row: the nodes that make their cos
    and sin from position_ids are cloned for that layer alone, reading position_ids + 1."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    targets = [n for n in graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN and _layer_of(n) == layer]
    assert len(targets) == 2
    producer = {o: n for n in graph.node for o in n.output}
    depends: dict[str, bool] = {}

    def on_positions(name: str) -> bool:  # does the value depend on position_ids?
        if name not in depends:
            node = producer.get(name)
            depends[name] = name == "position_ids" or (node is not None and any(on_positions(i) for i in node.input))
        return depends[name]

    chain, seen = [], set()

    def collect(name: str) -> None:
        node = producer.get(name)
        if node is None or id(node) in seen or not on_positions(name):
            return
        seen.add(id(node))
        for i in node.input:
            collect(i)
        chain.append(node)

    for node in targets:
        for name in node.input[1:3]:
            collect(name)
    assert chain, "the rotary nodes' caches do not depend on position_ids"
    renamed = {"position_ids": "planted_next_row"}
    clones = [helper.make_node("Add", ["position_ids", "planted_one"], ["planted_next_row"])]
    for node in chain:
        clone = onnx.NodeProto()
        clone.CopyFrom(node)
        clone.name = node.name + "_planted"
        for k, name in enumerate(clone.input):
            clone.input[k] = renamed.get(name, name)
        for k, name in enumerate(clone.output):
            renamed[name] = clone.output[k] = name + "_planted"
        clones.append(clone)
    for node in targets:
        for k in (1, 2):
            node.input[k] = renamed.get(node.input[k], node.input[k])
    graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=np.int64), "planted_one"))
    first = list(graph.node).index(targets[0])
    for k, clone in enumerate(clones):
        graph.node.insert(first + k, clone)
    return out


def test_layer_outputs_are_the_residual_stream_after_each_layer():
    graph = fp16_file().graph
    names, why = layer_outputs(graph, LAYERS)
    assert why == "" and len(names) == LAYERS
    producers = {o: n for n in graph.node for o in n.output}
    assert all(producers[name].op_type == "Add" and _layer_of(producers[name]) == i for i, name in enumerate(names))
    # the last layer's feeds the final norm, which is outside every layer
    readers = [n for n in graph.node if names[-1] in n.input]
    assert readers and all(_layer_of(n) is None for n in readers)


def test_layer_outputs_without_name_scopes_say_why():
    model = onnx.ModelProto()
    model.CopyFrom(fp16_file())
    for node in model.graph.node:
        del node.metadata_props[:]
    names, why = layer_outputs(model.graph, LAYERS)
    assert names == [] and "name scopes" in why


def test_clean_fp16_file_passes_by_pytorchs_own_error():
    report = check(fp16_file(), **SMALL)
    assert report.passed and report.rule is not None and report.rule.factor == PYTORCH_FACTOR
    (runner,) = report.compared
    logits = [s for stats in runner.cases.values() for s in stats if s.output == "logits"]
    assert logits and all(s.pytorch_max_abs > 0 and s.bound >= PYTORCH_FACTOR * s.pytorch_max_abs for s in logits)
    assert runner.layers is not None and runner.layers.first_outside is None
    assert len(runner.layers.errors) == len(report.pytorch_layers) == LAYERS
    # fp16 rounding, not zero: both the runner and PyTorch differ from the fp32 reference after every layer
    assert all(0 < e < 0.05 for e in [*runner.layers.errors, *report.pytorch_layers])
    # the error plot draws the rule that decided: each bucket's worst token error over that case's bound
    smallest, largest = min(s.bound for s in logits), max(s.bound for s in logits)
    buckets = runner.position_error.buckets()
    assert buckets and all(b["max_abs"] / largest * (1 - 1e-9) <= b["of_limit"] <= b["max_abs"] / smallest * (1 + 1e-9)
                           for b in buckets)
    assert max(b["of_limit"] for b in buckets) <= 1.0  # it passed, so every point is under the line
    from rope_export.check.report import error_plot_panels

    whole = error_plot_panels(report)[0]
    assert "PyTorch's own" in whole.limit_label and all(whole.series[0].passed)


@pytest.mark.parametrize("pieces", [False, True], ids=["one-session", "in-pieces"])
def test_planted_defect_is_found_at_its_layer(pieces):
    options = dict(SMALL, piece_limit_gb=1e-5) if pieces else SMALL
    report = check(next_cache_row_in_layer(fp16_file(), 1), **options)
    (runner,) = report.compared
    assert not report.passed
    if pieces:
        assert "pieces" in runner.reason
    assert runner.layers.first_outside == 1
    assert runner.layers.errors[0] <= runner.layers.bounds[0]  # layer 0 is untouched
    assert runner.layers.errors[1] > 5 * runner.layers.bounds[1]
    assert "first after decoder layer 1" in report.failure_message()


def test_cli_report_has_both_errors_the_ratio_and_the_plot(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save_model(fp16_file(), path)
    code = cli.main(["check", str(path), "--runners", "onnxruntime-cpu", "--no-sweep", "--batch", "1", "--seq", "4",
                     "--past", "2", "--long-seq", "8", "--report", str(tmp_path / "report")])
    out = capsys.readouterr().out
    assert code == 0
    assert "decided by: against PyTorch's own error" in out and "per layer: within PyTorch's envelope" in out
    data = json.loads((tmp_path / "report" / "check.json").read_text())
    logits = data["runners"][0]["cases"]["prefill"][0]
    assert logits["output"] == "logits"
    assert logits["ratio_to_pytorch"] == pytest.approx(logits["max_abs"] / logits["pytorch_max_abs"])
    assert len(data["pytorch_error_by_layer"]) == LAYERS
    markdown = (tmp_path / "report" / "check.md").read_text()
    assert "| runner | case | output | runner error | PyTorch error | ratio | bound | result |" in markdown
    pytest.importorskip("matplotlib")
    assert (tmp_path / "report" / "error_vs_layer.png").stat().st_size > 0


def test_precision_none_keeps_the_sqrt_layers_rule():
    report = check(fp16_file(), precision="none", **SMALL)
    assert report.rule is None and all(r.layers is None for r in report.runners)
    assert any("sqrt(3 layers)" in note for note in report.notes)


def test_unknown_precision_is_one_clear_error():
    from rope_export.check.model_file import CheckError

    with pytest.raises(CheckError, match="unknown reference precision 'fp8'; choose from auto, fp32, fp64, none"):
        check(fp16_file(), precision="fp8", **SMALL)


def test_float64_reference_for_a_small_model():
    report = check(fp16_file(), precision="fp64", **SMALL)
    assert report.passed and "run layer by layer in fp64 and in fp16" in report.reference
    (runner,) = report.compared
    assert runner.layers is not None and runner.layers.first_outside is None


def test_checkpoint_not_readable_by_layer_falls_back_with_a_note(tmp_path):
    """A .bin checkpoint cannot be read a layer at a time: the whole model in fp16 is the reference, as before."""
    import torch

    from rope_export import hf

    config = transformers.LlamaConfig(**json.loads(dict((p.key, p.value) for p in fp16_file().metadata_props)
                                                   ["rope_export.hf_config"]))
    model = hf.build_hf_model(config, seed=0, dtype="fp16")
    config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    report = check(fp16_file(), weights=tmp_path, **SMALL)
    assert report.passed and report.rule is None
    assert any(n.startswith("no fp32 reference layer by layer (CheckError:") and ".bin" in n for n in report.notes)
    assert "layer by layer" not in report.reference
